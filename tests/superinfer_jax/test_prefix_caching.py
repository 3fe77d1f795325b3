"""Prefix caching never changes output, and hits are real: greedy tokens with caching on
equal those of the same requests run alone on an engine with caching off, for repeated,
shared-prefix and multi-turn prompts (the second turn's prompt is the first turn's prompt,
its answer and a new message), under forced rotation and a device pool small enough to
reclaim cached pages and recompute, with async scheduling and without. Then isolation by
``cache_salt`` (on page ids), a page found by hash holding byte-exactly the KV written
when it was first computed, the one-token cap, and SmolLM2.

The host tier (``kv.host_cache``): pages the device evicted are found there and copied
back in (a waiting request admitted ROTATING_IN), with the same tokens as caching off, in
both tiers' isolation, holding byte-exactly the KV first computed (and, within a bound
derived from the computation, what a fresh prefill in another chunking computes); a hit
that goes between lookup and admission, or whose copy fails, falls back to prefill."""

from __future__ import annotations

import numpy as np
import pytest

from superinfer_jax import LLMEngine, SamplingParams
from superinfer_jax.kv.two_tier import PageMoves
from superinfer_jax.request import FieldError, RequestStatus
from superinfer_jax.sched.step_plan import StepPlan
from tests.numerics import assert_close, f32_tolerance, max_abs_diff
from tests.superinfer_jax.engine_testlib import SMALL, SMOLLM2_SMALL, TINY

SP = SamplingParams(max_tokens=12, ignore_eos=True)


def drain(engine: LLMEngine, ids, rotate_every: int = 0) -> list:
    step = 0
    while engine.has_unfinished_requests():
        engine.step()
        engine.kv.check_invariants()
        step += 1
        assert step < 50_000, "no progress"
        running = [r.req_id for r in engine.scheduler.running]
        if rotate_every and step % rotate_every == 0 and len(running) > 1:
            engine.force_rotate_out(running[step % len(running)])
    return [engine.release(i) for i in ids]


def alone(engine: LLMEngine, prompt) -> list[int]:
    (req,) = drain(engine, [engine.add_request(prompt, SP)])
    return req.output_token_ids


@pytest.fixture(scope="module")
def workload(tiny):
    """Two waves of prompts, and their tokens run alone with caching off."""
    rng = np.random.default_rng(3)
    stem = rng.integers(0, 250, 20).tolist()  # 2.5 pages of 8
    first = [stem + rng.integers(0, 250, 5).tolist(), stem[:17] + [7, 7, 7],
             rng.integers(0, 250, 24).tolist()]
    off = LLMEngine(tiny, SMALL.replace(enable_prefix_caching=False))
    ref_first = [alone(off, p) for p in first]
    turn2 = first[0] + ref_first[0] + [11, 12, 13]  # multi-turn: history + new message
    second = [first[0], first[2], stem + [1, 2, 3], turn2, first[1][:16]]
    ref_second = [alone(off, p) for p in second]
    return first, ref_first, second, ref_second


@pytest.mark.parametrize("async_scheduling,rotate_every,pages", [
    (True, 0, None), (False, 0, None), (True, 3, 16), (False, 4, 16)])
def test_greedy_tokens_equal_with_caching_on(tiny, workload, async_scheduling, rotate_every,
                                             pages):
    first, ref_first, second, ref_second = workload
    engine = LLMEngine(tiny, SMALL.replace(async_scheduling=async_scheduling,
                                           num_device_pages=pages, num_host_pages=64))
    done1 = drain(engine, [engine.add_request(p, SP) for p in first], rotate_every)
    assert [r.output_token_ids for r in done1] == ref_first
    done = drain(engine, [engine.add_request(p, SP) for p in second], rotate_every)
    assert [r.output_token_ids for r in done] == ref_second
    stats = engine.stats()
    assert stats["prefix_cache_hits"] > 0 and stats.prefix_cache is not None
    assert sum(r.num_cached_tokens for r in done) > 0
    assert done[0].num_cached_tokens >= 16  # the repeated prompt
    assert done[3].num_cached_tokens >= 24  # the second turn finds the first turn's pages
    if rotate_every:
        assert sum(r.num_rotations for r in done) > 0
    assert engine.kv.num_free_pages == engine.kv.allocator.num_usable  # nothing leaked
    # Which tier served: each admission counts its hit in one tier (a request preempted
    # and admitted again counts again), and a host hit is a copy brought in.
    cached = sum(r.num_cached_tokens for r in done1 + done)
    host = stats["prefix_cache_host_hits"]
    assert stats["prefix_cache_hits"] + host >= cached and host % SMALL.hardware.page_size == 0
    assert (host > 0) == (stats["transfer_prefix_hits_in"] > 0)
    # SMALL's own pool holds every cached page: none reclaimed, every hit a device hit
    if pages is None:
        assert engine.kv.prefix_cache.evictions == 0 and not engine.kv.host_cache
        assert host == stats["transfer_prefix_hits_in"] == 0
        assert stats["prefix_cache_hits"] == cached  # and no request was admitted twice


def record_plans(engine: LLMEngine) -> list[StepPlan]:
    """Every plan the engine's scheduler makes from now on (admissions by a host hit, their
    page copies)."""
    plans: list[StepPlan] = []
    schedule = engine.scheduler.schedule

    def recording(*args, **kwargs):
        plans.append(schedule(*args, **kwargs))
        return plans[-1]

    engine.scheduler.schedule = recording
    return plans


def host_hit_moves(plans: list[StepPlan]) -> dict[str, PageMoves]:
    """req_id -> the copies that brought its host-tier hit in (its last, if several)."""
    return {m.req_id: m for p in plans for m in p.moves_in if m.prefix_hit}


def unrelated(seed: int, n: int, length: int = 30) -> list[list[int]]:
    """Prompts that share no page with the workload: traffic that makes the device reclaim
    cached pages (their shadows stay findable in the host tier)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 250, length).tolist() for _ in range(n)]


def pages_on_device(engine: LLMEngine, req) -> int:
    return len(engine.kv.match_prefix(req.block_hashes, len(req.block_hashes)))


def pages_on_host(engine: LLMEngine, req) -> int:
    return len(engine.kv.match_host_prefix(req.block_hashes, 0, len(req.block_hashes)))


@pytest.mark.parametrize("async_scheduling,rotate_every", [
    (True, 0), (False, 0), (True, 3), (False, 4)])
def test_greedy_tokens_equal_with_host_tier_hits(tiny, workload, async_scheduling,
                                                 rotate_every):
    """The first wave's pages leave the device (other traffic reclaims them) and stay in
    the host tier; the second wave (repeated prompts, a shared stem, the second turn) finds
    them there, is admitted ROTATING_IN while they are copied in, and generates the tokens
    it generates alone with caching off."""
    first, ref_first, second, ref_second = workload
    engine = LLMEngine(tiny, SMALL.replace(async_scheduling=async_scheduling,
                                           num_device_pages=16, num_host_pages=64))
    done1 = drain(engine, [engine.add_request(p, SP) for p in first], rotate_every)
    assert [r.output_token_ids for r in done1] == ref_first
    drain(engine, [engine.add_request(p, SP) for p in unrelated(5, 3)], rotate_every)
    # precondition: the first wave's pages left the device, and the host tier kept some
    assert sum(pages_on_device(engine, r) for r in done1) == 0
    assert sum(pages_on_host(engine, r) for r in done1) >= 3
    before = engine.stats()
    plans = record_plans(engine)
    ids = [engine.add_request(p, SP) for p in second]
    done = drain(engine, ids, rotate_every)
    assert [r.output_token_ids for r in done] == ref_second
    stats = engine.stats()
    host_hits = stats["prefix_cache_host_hits"] - before["prefix_cache_host_hits"]
    admitted = stats["transfer_prefix_hits_in"] - before["transfer_prefix_hits_in"]
    assert host_hits > 0 and admitted > 0
    moves = host_hit_moves(plans)
    assert len(moves) <= admitted and set(moves) <= set(ids)  # only this wave's requests
    assert sum(len(m) for m in moves.values()) * SMALL.hardware.page_size <= host_hits
    for rid, m in moves.items():  # a hit at its (only) admission is in its cached tokens
        req = done[ids.index(rid)]
        if not req.num_preemptions:  # else it counts the first admission's hit
            assert req.num_cached_tokens >= len(m) * SMALL.hardware.page_size
    assert engine.duplex.stats.failures == 0
    if rotate_every:
        assert sum(r.num_rotations for r in done) > 0
    engine.kv.check_invariants()
    assert engine.kv.num_free_pages == engine.kv.allocator.num_usable  # nothing leaked


def test_salts_isolate_and_found_pages_hold_their_kv(tiny):
    engine = LLMEngine(tiny, SMALL)
    prompt = list(range(30, 50))  # two full pages and 4 tokens
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    x = engine.add_request(prompt, sp, cache_salt="tenant-x")
    for _ in range(3):
        engine.step()
    x_pages = list(engine.kv.page_table(x))
    written = np.asarray(engine.kv_pool[np.array(x_pages[:2])]).copy()  # as first computed
    y = engine.add_request(prompt, sp, cache_salt="tenant-y")
    z = engine.add_request(prompt, sp, cache_salt="tenant-x")
    n = engine.add_request(prompt, sp)  # no salt: its own namespace too
    engine.step()
    for _ in range(8):  # x goes on decoding, writing its tail page: full pages stay put
        engine.step()
    tables = {r: engine.kv.page_table(r) for r in (y, z, n)}
    assert not set(tables[y]) & set(x_pages) and not set(tables[n]) & set(x_pages)
    assert not set(tables[y]) & set(tables[n])
    assert tables[z][:2] == x_pages[:2]  # the same salt shares the full pages
    assert engine.requests[z].num_cached_tokens == 16
    assert engine.requests[y].num_cached_tokens == engine.requests[n].num_cached_tokens == 0
    now = np.asarray(engine.kv_pool[np.array(tables[z][:2])])
    assert now.tobytes() == written.tobytes()  # byte-exact: the KV of its tokens
    drain(engine, [x, y, z, n])
    with pytest.raises(FieldError) as e:
        engine.add_request(prompt, sp, cache_salt="")
    assert e.value.field == "cache_salt"
    with pytest.raises(FieldError):
        engine.add_request(prompt, sp, cache_salt="s" * 257)


def kv_bound(reference: np.ndarray, context_len: int) -> np.ndarray:
    """Per (layer, K|V) bound on the KV of pages ``[page, layer, K|V, ...]`` computed two
    ways (tests/numerics): float32 with an absolute bound ``f32_tolerance``, where

    - the scale is the largest compared value of that layer's K (or V): a projection's
      rounding error scales with its terms, and a relative error upstream reaches K and
      V unchanged in size (a linear map multiplies value and error alike; RMSNorm
      rescales both);
    - the longest reduction on the way is the FFN's down projection, the hidden size
      (projections, RMSNorm), the head dim (scores) or the context (attention's weighted
      sum), whichever is longest;
    - layer ``l``'s K and V come out of ``l`` decoder blocks and one projection, so
      ``depth = l + 1``: layer 0 depends on the token and its position only; every layer
      after it also on attention over the other tokens, whose summation order the
      chunking changes (other keys per call, other partial softmax sums)."""
    n = max(TINY.hidden_size, TINY.intermediate_size, TINY.head_dim, context_len)
    layers = reference.shape[1]
    return np.array([[f32_tolerance(reference[:, layer, kv], n, depth=layer + 1)
                      for kv in range(2)] for layer in range(layers)])


def test_host_tier_pages_hold_their_kv(tiny):
    """A page found in the host tier and copied into a fresh device page holds byte-exactly
    the KV written when it was first computed (the device page it was computed in has been
    reused since, so only the copy can bring it back), and, within a bound derived from
    the computation, the KV a fresh prefill of the same tokens in other chunks computes."""
    engine = LLMEngine(tiny, SMALL.replace(num_device_pages=16, num_host_pages=64))
    assert engine.kv_pool.dtype == np.float32  # the bound below is float32's
    prompt = list(range(100, 125))  # three full pages and one token
    rid = engine.add_request(prompt, SP)
    req = engine.requests[rid]
    while req.num_computed_tokens < 24:
        engine.step()
    pages = list(engine.kv.page_table(rid)[:3])
    written = np.asarray(engine.kv_pool[np.array(pages)]).copy()  # as first computed
    (first,) = drain(engine, [rid])
    drain(engine, [engine.add_request(p, SP) for p in unrelated(7, 3)])
    assert pages_on_device(engine, first) == 0 and pages_on_host(engine, first) >= 3
    for i, page in enumerate(pages):  # the device pages it was computed in were reused
        assert np.asarray(engine.kv_pool[page]).tobytes() != written[i].tobytes()
    plans = record_plans(engine)
    again = engine.add_request(prompt + [1, 2], SP)
    req = engine.requests[again]
    engine.step()
    assert req.status == RequestStatus.ROTATING_IN  # admitted by the host hit
    while req.status != RequestStatus.RUNNING:
        engine.step()
    (moves,) = host_hit_moves(plans).values()
    table = engine.kv.page_table(again)
    assert list(moves.device_pages) == table[:3] and req.num_cached_tokens == 24
    landed = np.asarray(engine.kv_pool[np.array(table[:3])])
    assert landed.tobytes() == written.tobytes()  # byte-exact: the KV of its tokens
    drain(engine, [again])

    # A fresh computation: caching off, chunks of 8 instead of 16 (16 + 9 above).
    off = LLMEngine(tiny, SMALL.replace(num_device_pages=16, enable_prefix_caching=False,
                                        max_prefill_chunk=8))
    rid = off.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    req = off.requests[rid]
    while req.num_computed_tokens < 24:
        off.step()
    fresh = np.asarray(off.kv_pool[np.array(off.kv.page_table(rid)[:3])]).copy()
    drain(off, [rid])
    bound = kv_bound(fresh, len(prompt))
    for layer, kv in np.ndindex(bound.shape):
        assert_close(landed[:, layer, kv], fresh[:, layer, kv], bound[layer, kv],
                     f"layer {layer} {'KV'[kv]}")
        # the bound tells pages apart: the KV of the neighbouring tokens is far outside it
        assert max_abs_diff(landed[1:, layer, kv], fresh[:-1, layer, kv]) > bound[layer, kv]


def reclaim_device_cache(engine: LLMEngine) -> None:
    """What another admission does to the cache when it takes every page the device has
    room for (free ones, then cached ones, least recently released first) and leaves:
    the device forgets every cached page, and a page with a shadow stays findable in the
    host tier (within its cap, the coldest going first)."""
    kv = engine.kv
    kv.allocate_for("squatter", kv.num_free_pages * kv.page_size)
    assert kv.num_cached_pages == 0
    kv.free("squatter")
    kv.check_invariants()


@pytest.mark.parametrize("contended", [False, True])
@pytest.mark.parametrize("host_cap,hit_pages,host_pages", [
    (0, 0, 0),  # no host cache: the hit is gone, the prompt is prefilled
    (1, 1, 1),  # the host tier keeps the first page only: one page hit, the rest prefilled
    (None, 3, 3),  # the host tier keeps them all: the same hit, from the other tier
])
def test_prefix_evicted_between_lookup_and_admission(tiny, workload, monkeypatch, contended,
                                                     host_cap, hit_pages, host_pages):
    """A waiting request's hit (three device pages) is looked up, then goes before its
    admission: admission looks again, takes what is left (in either tier), prefills the
    rest, reports that smaller hit, and generates the tokens of caching off.

    Uncontended (FCFS), the lookup is ``prefix_hit`` as the ranking calls it, before the
    step. Contended (rotasched, contention forced), it is the step's own: the ranking and
    the selection look the hit up and keep it for the step, and the pages go after the
    selection, before admission, within the same step."""
    first, ref_first, *_ = workload
    prompt, ref = first[0], ref_first[0]  # 25 tokens: three full pages can be found
    engine = LLMEngine(tiny, SMALL.replace(num_device_pages=16, num_host_pages=64,
                                           host_cache_max_pages=host_cap,
                                           policy="rotasched" if contended else "fcfs"))
    drain(engine, [engine.add_request(prompt, SP)])
    rid = engine.add_request(prompt, SP)
    req = engine.requests[rid]
    sched = engine.scheduler
    hit = sched.prefix_hit(req)
    assert len(hit.device) == 3 and not hit.host  # what the ranking and selection see
    if contended:
        monkeypatch.setattr(sched.policy, "contended", lambda s: True)
        run_rows, reclaimed = sched._run_rows, []

        def run_rows_then_reclaim(*args, **kwargs):  # after the selection, before admission
            run_rows(*args, **kwargs)
            if not reclaimed:
                assert sched.prefixes.hits[rid] == hit  # the step's ranking looked it up
                reclaim_device_cache(engine)
                reclaimed.append(True)

        monkeypatch.setattr(sched, "_run_rows", run_rows_then_reclaim)
    else:
        reclaim_device_cache(engine)  # ... then another admission takes the pages
    plans = record_plans(engine)
    before = engine.stats()
    (done,) = drain(engine, [rid])
    assert not contended or reclaimed
    assert done.output_token_ids == ref
    assert done.num_cached_tokens == hit_pages * SMALL.hardware.page_size
    stats = engine.stats()
    assert stats["prefix_cache_hits"] == before["prefix_cache_hits"]  # nothing on device
    host_hits = stats["prefix_cache_host_hits"] - before["prefix_cache_host_hits"]
    assert host_hits == host_pages * SMALL.hardware.page_size
    moves = host_hit_moves(plans)
    assert [len(m) for m in moves.values()] == ([host_pages] if host_pages else [])
    assert done.num_preemptions == 0 and engine.duplex.stats.failures == 0


def test_failed_host_hit_copy_falls_back_to_prefill(tiny, workload, monkeypatch):
    """The host->device copy of a host hit fails once: the request drops the pages it was
    given and is prefilled from scratch, with the tokens of caching off; the pages it
    computes then serve a later device hit with the same tokens."""
    first, ref_first, *_ = workload
    prompt, ref = first[0], ref_first[0]
    engine = LLMEngine(tiny, SMALL.replace(num_device_pages=16, num_host_pages=64))
    drain(engine, [engine.add_request(prompt, SP)])
    reclaim_device_cache(engine)
    calls = {"n": 0}
    real = engine.duplex._copy_in

    def fail_once(*args):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected host->device copy failure")
        return real(*args)

    monkeypatch.setattr(engine.duplex, "_copy_in", fail_once)
    plans = record_plans(engine)
    (done,) = drain(engine, [engine.add_request(prompt, SP)])
    assert done.output_token_ids == ref
    assert len(host_hit_moves(plans)) == 1 and calls["n"] == 1  # admitted by the host hit
    assert engine.duplex.stats.failures == 1 and done.num_preemptions == 1
    assert done.num_recomputed_tokens == 24  # the hit it expected, prefilled instead
    stats = engine.stats()
    assert stats["transfer_prefix_hits_in"] == 0  # the copy never went out
    # and it is not reported as a hit: usage, and the host tier's counter
    assert done.num_cached_tokens == 0 and stats["prefix_cache_host_hits"] == 0
    # the failed hit's host pages were dropped, not served later; the prefill's pages are
    (again,) = drain(engine, [engine.add_request(prompt, SP)])
    assert again.output_token_ids == ref and again.num_cached_tokens == 24
    assert engine.stats()["prefix_cache_host_hits"] == stats["prefix_cache_host_hits"]


def test_a_prefix_on_its_way_in_is_waited_for(tiny, workload):
    """Two requests need the same host-tier prefix in one step: the first rotates it in,
    the second waits for it to land and takes it as a device hit, instead of prefilling
    it again (or finding nothing: the host pages became the first one's shadows)."""
    first, ref_first, *_ = workload
    prompt, ref = first[0], ref_first[0]
    engine = LLMEngine(tiny, SMALL.replace(num_device_pages=16, num_host_pages=64))
    drain(engine, [engine.add_request(prompt, SP)])
    reclaim_device_cache(engine)
    plans = record_plans(engine)
    a, b = drain(engine, [engine.add_request(prompt, SP) for _ in range(2)])
    assert a.output_token_ids == b.output_token_ids == ref
    assert list(host_hit_moves(plans)) == [a.req_id]  # one copy in, for the first
    assert a.num_cached_tokens == b.num_cached_tokens == 24  # the second: device hit
    assert not engine.kv.arriving


def test_salts_isolate_the_host_tier(tiny, workload):
    """Pages of one salt (or of none) in the host tier are found only by requests of the
    same salt: another salt gets no hit at all, and each tenant's hit copies in exactly
    the host pages its own pages became."""
    first, ref_first, *_ = workload
    prompt, ref = first[0], ref_first[0]
    engine = LLMEngine(tiny, SMALL.replace(num_device_pages=16, num_host_pages=64))
    x = drain(engine, [engine.add_request(prompt, SP, cache_salt="tenant-x")])[0]
    n = drain(engine, [engine.add_request(prompt, SP)])[0]
    assert x.num_cached_tokens == n.num_cached_tokens == 0
    reclaim_device_cache(engine)
    x_host = engine.kv.match_host_prefix(x.block_hashes, 0, 3)
    n_host = engine.kv.match_host_prefix(n.block_hashes, 0, 3)
    assert len(x_host) == len(n_host) == 3 and not set(x_host) & set(n_host)
    plans = record_plans(engine)
    before = engine.stats()
    y = drain(engine, [engine.add_request(prompt, SP, cache_salt="tenant-y")])[0]
    assert y.num_cached_tokens == 0 and not host_hit_moves(plans)
    assert engine.stats()["prefix_cache_host_hits"] == before["prefix_cache_host_hits"]
    assert engine.kv.match_host_prefix(x.block_hashes, 0, 3) == x_host  # untouched
    assert engine.kv.match_host_prefix(n.block_hashes, 0, 3) == n_host
    z, m = drain(engine, [engine.add_request(prompt, SP, cache_salt="tenant-x"),
                          engine.add_request(prompt, SP)])
    moves = host_hit_moves(plans)
    assert set(moves) == {z.req_id, m.req_id}
    assert list(moves[z.req_id].host_pages) == x_host
    assert list(moves[m.req_id].host_pages) == n_host
    assert z.num_cached_tokens == m.num_cached_tokens == 24
    assert [r.output_token_ids for r in (x, n, y, z, m)] == [ref] * 5


def test_one_token_is_always_computed(tiny):
    """A prompt of exactly two pages, repeated: one page is a hit, the second is computed
    (its last token gives the first output token's logits)."""
    engine = LLMEngine(tiny, SMALL)
    prompt = list(range(60, 76))
    first = drain(engine, [engine.add_request(prompt, SP)])[0]
    again = drain(engine, [engine.add_request(prompt, SP)])[0]
    assert again.num_cached_tokens == 8
    assert again.output_token_ids == first.output_token_ids


@pytest.mark.parametrize("generated", [True, False])
def test_generated_pages_are_cached_only_when_asked(tiny, workload, generated):
    """``prefix_cache_generated``: on (vLLM's way), a finished request's full pages of
    generated tokens are findable and the next turn of a conversation hits them; off
    (prompt pages only), only pages wholly inside a prompt are, and the next turn hits its
    history's prompt pages and computes the rest, with the same tokens."""
    first, ref_first, second, ref_second = workload
    engine = LLMEngine(tiny, SMALL.replace(prefix_cache_generated=generated))
    done1 = drain(engine, [engine.add_request(p, SP) for p in first])
    assert [r.output_token_ids for r in done1] == ref_first
    page = SMALL.hardware.page_size
    # first: 25, 20 and 24 prompt tokens plus 12 outputs each, KV for all but the last
    # output (36, 31 and 35 tokens); the first two share the 2-page stem. Pages wholly in
    # a prompt: 3 + 0 + 3 of their own; every full page: 4 + 1 + 4.
    assert [len(p) for p in first] == [25, 20, 24]
    assert len(engine.kv.prefix_cache.pages_of) == (9 if generated else 6)
    done = drain(engine, [engine.add_request(p, SP) for p in second])
    assert [r.output_token_ids for r in done] == ref_second
    # turn 2 = first[0] (25) + its 12 outputs + 3: its history fills 4 pages, of which 3
    # lie wholly in the first turn's prompt
    assert done[3].num_cached_tokens == (4 if generated else 3) * page
    assert done[0].num_cached_tokens == 3 * page  # a repeated prompt hits either way
    assert engine.kv.num_free_pages == engine.kv.allocator.num_usable


@pytest.fixture(scope="module")
def smollm2_engines(smollm2):
    """SmolLM2 engines with caching off and on, with the shapes of the SmolLM2 rotation
    test (the persistent XLA cache serves both); built once, they compile once."""
    cfg = SMOLLM2_SMALL
    return (LLMEngine(smollm2, cfg.replace(enable_prefix_caching=False)),
            LLMEngine(smollm2, cfg))


def smollm2_question(tok, question: str) -> list[int]:
    return tok.encode("You are a helpful assistant. Answer every question in one short "
                      "sentence, and never more. Question: ") + tok.encode(question)


def test_smollm2_greedy_tokens_equal_with_caching(smollm2, smollm2_engines):
    off, on = smollm2_engines
    tok = smollm2.tokenizer
    prompts = [smollm2_question(tok, q) for q in ("What is the capital of France?",
                                                  "What is the capital of Italy?")]
    ref = [alone(off, p) for p in prompts]
    got = [drain(on, [on.add_request(p, SP)])[0] for p in prompts]
    assert [r.output_token_ids for r in got] == ref
    assert got[1].num_cached_tokens >= 16


def test_smollm2_greedy_tokens_equal_with_a_host_tier_hit(smollm2, smollm2_engines):
    """The second turn of a conversation whose first turn's pages the device reclaimed
    (two prefill-only requests fill the 7-page pool): both full pages come back from the
    host tier, and the tokens are those of caching off."""
    off, on = smollm2_engines
    tok = smollm2.tokenizer
    prompt = smollm2_question(tok, "What is the capital of Spain?")  # 28 tokens
    first = drain(on, [on.add_request(prompt, SP)])[0]
    story = tok.encode("Once upon a time there was a little robot who lived in a big city "
                       "full of lights and noise, and every day it walked to the old "
                       "library at the end of the street to read about the sea, the "
                       "mountains and the stars, dreaming of the journeys it would make")
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    for filler in (story[:56], story[1:57]):  # 4 pages each
        drain(on, [on.add_request(filler, one)])
    turn2 = prompt + first.output_token_ids + tok.encode(" And of Portugal?")
    assert len(turn2) > 32 and len(turn2) + SP.max_tokens <= on.config.model.max_model_len
    assert pages_on_device(on, first) == 0 and pages_on_host(on, first) == 2
    plans = record_plans(on)
    before = on.stats()
    second = drain(on, [on.add_request(turn2, SP)])[0]
    stats = on.stats()
    assert second.output_token_ids == alone(off, turn2)
    assert first.output_token_ids == alone(off, prompt)
    assert list(host_hit_moves(plans)) == [second.req_id]
    assert second.num_cached_tokens == 32  # both pages of the first turn's prompt
    assert stats["prefix_cache_host_hits"] - before["prefix_cache_host_hits"] == 32
    assert stats["transfer_prefix_hits_in"] - before["transfer_prefix_hits_in"] == 1
