"""RotaSched and prefix hits (host code only): cached pages are reclaimed before any runner
moves, the selection counts a shared page once and a hit's pages as computed, and slack
mode prices a hit as a transfer (its host part) plus a shorter prefill."""

from __future__ import annotations

from superinfer_jax.config import RotaSchedConfig
from superinfer_jax.kv.prefix_cache import extend_block_hashes
from superinfer_jax.request import RequestStatus
from superinfer_jax.sched.latency import LatencyModel
from superinfer_jax.sched.step_plan import StepBudget
from tests.superinfer_jax.sched_kit import KEY, PAGE, Driver, make, req

# Prefix caching on both tiers, and a page's transfer priced (1000 bytes a page).
HITS = {"prefix_caching": True, "page_bytes": 1000}


def test_cached_pages_are_reclaimed_before_any_runner_moves():
    # 12 usable pages: a finished request leaves 4 cached; two new ones need 6 pages each,
    # so the cached pages must go (above the high-water mark: RotaSched is acting)
    sched, kv = make("rotasched", 13, 32, **HITS, rotasched=RotaSchedConfig(
        min_residency_tokens=4, high_water_mark=0.5))
    d = Driver(sched, kv)
    d.add(req("a", range(100, 116), 0.0, max_tokens=2, cached=True))
    t = 0.0
    while sched.num_unfinished:
        d.step(t)
        t += 1
    assert kv.num_cached_pages == 4
    for rid, base in (("b", 200), ("c", 300)):
        d.add(req(rid, range(base, base + 16), t, cached=True))
    plans, contended = [], []
    while sched.num_unfinished:
        contended.append(sched.policy.contended(sched))
        plans.append(d.step(t))
        t += 1
    assert all(not p.rotate_out and not p.preempted for p in plans), "a runner moved"
    assert any(contended)  # RotaSched ranked and selected, and still moved nobody
    assert kv.prefix_cache.evictions >= 4  # the cached pages were taken instead
    assert all(d.all[r].status == RequestStatus.FINISHED_LENGTH for r in "bc")


def test_selection_counts_a_hits_shared_pages_once():
    """A runner holds 4 full pages; waiting ``w`` extends its prompt (a 4-page hit, 2 new
    pages) and ``x`` needs 5: 5 + 2 + 5 = 12 pages, exactly the pool. Counted without
    the hit (6 for ``w``) ``x`` would not fit."""
    # contended from the start (high-water mark 0.1): _select runs
    sched, kv = make("rotasched", 13, 32, **HITS, rotasched=RotaSchedConfig(
        min_residency_tokens=4, high_water_mark=0.1))
    d = Driver(sched, kv)
    reqs = d.all
    stem = list(range(100, 116))
    d.add(req("r", stem, 0.0, max_tokens=4, cached=True))
    d.step(0.0)  # r prefilled: its 4 full pages are registered next step
    d.add(req("w", stem + [1, 2, 3, 4, 5, 6, 7, 8], 1.0, cached=True))
    d.add(req("x", range(300, 320), 1.0, cached=True))
    sched.prefixes.register_full_pages()
    hit = sched.prefix_hit(reqs["w"])
    assert hit.device == tuple(kv.page_table("r")[:4]) and not hit.host
    ranked = [reqs["r"], reqs["w"], reqs["x"]]
    keep = sched._select(ranked, StepBudget.full(sched.config)).keep
    assert keep == {"r", "w", "x"}
    plan = d.step(1.0)
    admitted = {rid for rid, _ in plan.prefill}
    assert {"w", "x"} <= admitted and not plan.rotate_out and not plan.preempted
    assert reqs["w"].num_cached_tokens == 16
    assert kv.page_table("w")[:4] == kv.page_table("r")[:4]


def test_slack_prices_a_host_hit_as_transfer_plus_a_shorter_prefill():
    sched, kv = make("rotasched", 8, 16, **HITS,
                     rotasched=RotaSchedConfig(min_residency_tokens=4, mode="slack"))
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
    w, cold = req("w", stem, 0.0, cached=True), req("cold", range(500, 520), 0.0, cached=True)
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
