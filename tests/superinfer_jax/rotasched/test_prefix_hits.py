"""RotaSched and prefix hits (host code only): cached pages are reclaimed before any runner
moves, the selection counts a shared page once and a hit's pages as computed, and slack
mode prices a hit as a transfer (its host part) plus a shorter prefill."""

from __future__ import annotations

from superinfer_jax.config import EngineConfig, RotaSchedConfig
from superinfer_jax.kv.prefix_cache import extend_block_hashes, isolation_key
from superinfer_jax.kv.two_tier import TwoTierKVManager
from superinfer_jax.request import SLO, Request, RequestStatus, SamplingParams
from superinfer_jax.sched.latency import LatencyModel
from superinfer_jax.sched.rotasched.registry import make_scheduler
from superinfer_jax.sched.step_plan import StepBudget

PAGE = 4
KEY = isolation_key("test-model", None)


def make(device_pages: int, host_pages: int = 32, **rotasched):
    rotasched.setdefault("min_residency_tokens", 4)
    cfg = EngineConfig(page_size=PAGE, max_model_len=128, warmup=False, policy="rotasched",
                       max_num_batched_tokens=64, max_prefill_chunk=32,
                       rotasched=RotaSchedConfig(**rotasched))
    kv = TwoTierKVManager(device_pages, PAGE, host_pages, prefix_caching=True)
    return make_scheduler(cfg, kv, page_bytes=1000), kv


def req(rid: str, prompt: list[int], arrival: float = 0.0, max_tokens: int = 8) -> Request:
    r = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens),
                slo=SLO(ttft_ms=1000, tbt_ms=100), arrival_time=arrival)
    r.cache_key = KEY
    return r


def run(sched, kv, reqs: dict[str, Request], now: float):
    """One step, applied as the engine would (rotations land at once)."""
    plan = sched.schedule(now)
    for rid in plan.rotate_out:
        kv.finish_rotate_out(rid)
        sched.on_rotated_out(reqs[rid], now)
    for rid in plan.rotate_in + plan.host_hits:
        kv.finish_rotate_in(rid)
        sched.on_rotated_in(reqs[rid], now)
    for rid, n in plan.prefill + [(r, 1) for r in plan.decode]:
        r = reqs[rid]
        r.num_computed_tokens += n
        if r.num_computed_tokens == r.num_tokens:
            r.output_token_ids.append(7)
            r.token_times.append(now)
            if len(r.output_token_ids) >= r.sampling.max_tokens:
                sched.remove(r)
                r.set_status(RequestStatus.FINISHED_LENGTH, now)
    kv.check_invariants()
    return plan


def test_cached_pages_are_reclaimed_before_any_runner_moves():
    # 12 usable pages: a finished request leaves 4 cached; two new ones need 6 pages each,
    # so the cached pages must go (above the high-water mark: RotaSched is acting)
    sched, kv = make(13, high_water_mark=0.5)
    reqs = {"a": req("a", list(range(100, 116)), max_tokens=2)}
    sched.add(reqs["a"])
    t = 0.0
    while sched.num_unfinished:
        run(sched, kv, reqs, t)
        t += 1
    assert kv.num_cached_pages == 4
    for rid, base in (("b", 200), ("c", 300)):
        reqs[rid] = req(rid, list(range(base, base + 16)), arrival=t)
        sched.add(reqs[rid])
    plans, contended = [], []
    while sched.num_unfinished:
        contended.append(sched.policy.contended(sched))
        plans.append(run(sched, kv, reqs, t))
        t += 1
    assert all(not p.rotate_out and not p.preempted for p in plans), "a runner moved"
    assert any(contended)  # RotaSched ranked and selected, and still moved nobody
    assert kv.prefix_cache.evictions >= 4  # the cached pages were taken instead
    assert all(reqs[r].status == RequestStatus.FINISHED_LENGTH for r in "bc")


def test_selection_counts_a_hits_shared_pages_once():
    """A runner holds 4 full pages; waiting ``w`` extends its prompt (a 4-page hit, 2 new
    pages) and ``x`` needs 5: 5 + 2 + 5 = 12 pages, exactly the pool. Counted without
    the hit (6 for ``w``) ``x`` would not fit."""
    sched, kv = make(13, high_water_mark=0.1)  # contended from the start: _select runs
    stem = list(range(100, 116))
    reqs = {"r": req("r", stem, max_tokens=4)}
    sched.add(reqs["r"])
    run(sched, kv, reqs, 0.0)  # r prefilled: its 4 full pages are registered next step
    reqs["w"] = req("w", stem + [1, 2, 3, 4, 5, 6, 7, 8], arrival=1.0)
    reqs["x"] = req("x", list(range(300, 320)), arrival=1.0)
    sched.add(reqs["w"])
    sched.add(reqs["x"])
    sched.prefixes.register_full_pages()
    hit = sched.prefix_hit(reqs["w"])
    assert hit.device == tuple(kv.page_table("r")[:4]) and not hit.host
    ranked = [reqs["r"], reqs["w"], reqs["x"]]
    keep = sched._select(ranked, StepBudget.full(sched.config)).keep
    assert keep == {"r", "w", "x"}
    plan = run(sched, kv, reqs, 1.0)
    admitted = {rid for rid, _ in plan.prefill}
    assert {"w", "x"} <= admitted and not plan.rotate_out and not plan.preempted
    assert reqs["w"].num_cached_tokens == 16
    assert kv.page_table("w")[:4] == kv.page_table("r")[:4]


def test_slack_prices_a_host_hit_as_transfer_plus_a_shorter_prefill():
    sched, kv = make(8, host_pages=16, mode="slack")
    lm = LatencyModel(prefill=[0.01, 0.001, 0.0], decode=[0.01, 0.0, 0.0],
                      transfer=[0.002, 1e-6])
    sched.set_latency_model(lm)
    stem = list(range(100, 120))  # 5 pages; a hit may cover 4 (one token is computed)
    hashes: list[bytes] = []
    extend_block_hashes(hashes, stem, (), PAGE, KEY)
    # the first 4 pages, cached on the host only: shadows of device pages since evicted
    kv.allocate_for("old", 16)
    kv.register_full_pages("old", hashes, 16)
    kv.plan_shadows({"old": 16}, 8)
    kv.free("old")
    kv.allocate_for("flood", 7 * PAGE)  # takes every device page: the cached ones go
    kv.free("flood")
    assert kv.match_prefix(hashes, 4) == [] and len(kv.match_host_prefix(hashes, 0, 4)) == 4
    w, cold = req("w", stem), req("cold", list(range(500, 520)))
    for r in (w, cold):
        sched.add(r)
    hit = sched.prefix_hit(w)
    assert len(hit.host) == 4 and not hit.device
    now = 0.1
    slack_hit = sched.policy.predicted_slack(sched, w, now)
    slack_cold = sched.policy.predicted_slack(sched, cold, now)
    assert slack_cold == w.arrival_time + 1.0 - now - lm.prefill_s(20, 0)
    assert slack_hit == w.arrival_time + 1.0 - now - (lm.prefill_s(4, 16)
                                                      + lm.transfer_s(4 * 1000))
    assert slack_hit > slack_cold
    plan = sched.schedule(now)  # admitted by the host hit: pages copied in, no row yet
    assert plan.host_hits == ["w"] and [len(m) for m in plan.moves_in] == [4]
    assert plan.moves_in[0].prefix_hit and w.status == RequestStatus.ROTATING_IN
    assert w.num_computed_tokens == 16 and w.num_cached_tokens == 16
