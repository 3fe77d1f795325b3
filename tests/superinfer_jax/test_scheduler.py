"""FCFS scheduler plans on scripted requests, checked step by step (no model, no arrays)."""

from __future__ import annotations

from superinfer_jax.config import EngineConfig, bucket
from superinfer_jax.kv.page_allocator import KVCacheManager
from superinfer_jax.request import Request, RequestStatus, SamplingParams
from superinfer_jax.rotasched.registry import make_scheduler
from superinfer_jax.scheduler import Scheduler


def make(num_pages=64, **kw):
    cfg = EngineConfig(page_size=4, max_model_len=64, warmup=False, **kw)
    kv = KVCacheManager(num_pages, cfg.page_size)
    return make_scheduler(cfg, kv), kv


def req(rid: str, n: int) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=8))


def complete(sched: Scheduler, plan, token: int = 7) -> None:
    """What the engine does after a step: account tokens, append one where a row ended."""
    for rid, n in plan.prefill + [(r, 1) for r in plan.decode]:
        r = next(x for x in sched.running if x.req_id == rid)
        r.num_computed_tokens += n
        if r.num_computed_tokens == r.num_tokens:
            r.output_token_ids.append(token)


def test_chunked_prefill_under_budget_then_decode():
    sched, kv = make(max_num_batched_tokens=16, max_prefill_chunk=16, max_prefill_rows=2)
    sched.add(req("a", 20))
    sched.add(req("b", 5))
    p1 = sched.schedule(0.0)
    assert p1.prefill == [("a", 16)] and p1.decode == []
    assert len(kv.page_table("a")) == 4
    complete(sched, p1)
    p2 = sched.schedule(1.0)
    # a second row would pad the call to 2x16 slots, over the 16-token budget
    assert p2.prefill == [("a", 4)]
    complete(sched, p2)
    p3 = sched.schedule(2.0)
    assert p3.decode == ["a"] and p3.prefill == [("b", 5)]
    complete(sched, p3)
    p4 = sched.schedule(3.0)
    assert p4.decode == ["a", "b"] and p4.prefill == []
    assert p4.num_tokens == 2


def test_prefill_rows_pack_only_within_the_padded_budget():
    """The prefill call runs padded to [row bucket, column bucket]: more rows join only
    while that padded shape fits the token budget."""
    sched, _ = make(max_num_batched_tokens=64, max_prefill_chunk=64, max_prefill_rows=4)
    for rid, n in (("long", 100), ("short", 10)):
        sched.add(req(rid, n))
    p1 = sched.schedule(0.0)
    assert p1.prefill == [("long", 64)]  # 1x64; with "short" it would be 4x64 = 256 slots
    complete(sched, p1)
    p2 = sched.schedule(1.0)
    assert p2.prefill == [("long", 36)]  # still padded to 64 columns
    sched2, _ = make(max_num_batched_tokens=64, max_prefill_chunk=64, max_prefill_rows=4)
    for rid, n in (("c", 10), ("d", 12), ("e", 14), ("f", 30)):
        sched2.add(req(rid, n))
    p = sched2.schedule(0.0)
    # 4x16 = 64 slots: "f" joins with a 16-token chunk, not its 30 (a 4x64 call)
    assert p.prefill == [("c", 10), ("d", 12), ("e", 14), ("f", 16)]


def test_fcfs_head_blocks_admission_when_pages_run_out():
    sched, kv = make(num_pages=9, max_num_batched_tokens=64, max_prefill_chunk=32)
    sched.add(req("big", 28))  # 7 pages of the 8 usable
    sched.add(req("small", 8))  # 2 pages: does not fit behind it
    sched.add(req("tiny", 2))  # would fit, but FCFS lets nobody overtake
    plan = sched.schedule(0.0)
    assert plan.prefill == [("big", 28)]
    assert [r.req_id for r in sched.waiting] == ["small", "tiny"]
    assert kv.num_free_pages == 1


def test_decode_out_of_pages_preempts_most_recent():
    sched, kv = make(num_pages=7, max_num_batched_tokens=64, max_prefill_chunk=32)
    for rid in ("a", "b", "c"):
        sched.add(req(rid, 8))  # 2 pages each: all 6 usable pages
    plan = sched.schedule(0.0)
    assert [r for r, _ in plan.prefill] == ["a", "b", "c"]
    complete(sched, plan)
    plan = sched.schedule(1.0)  # every request needs a third page for token 9
    assert plan.preempted == ["c"]  # freeing c's two pages is enough for a and b
    victim = next(r for r in sched.waiting if r.req_id == "c")
    assert victim.status == RequestStatus.WAITING
    assert victim.num_computed_tokens == 0 and victim.num_recomputed_tokens == 8
    assert victim.num_pending_tokens == 9  # prompt plus the token it already produced
    assert plan.decode == ["a", "b"]
    # invariant: scheduled requests own their pages; free + owned == usable
    assert kv.num_free_pages + kv.num_used_pages() == kv.allocator.num_usable


def test_max_num_seqs_caps_running():
    sched, _ = make(max_num_seqs=2, max_num_batched_tokens=64, max_prefill_chunk=32)
    for rid in "abc":
        sched.add(req(rid, 3))
    plan = sched.schedule(0.0)
    assert [r for r, _ in plan.prefill] == ["a", "b"]
    assert len(sched.waiting) == 1


def test_remove_frees_pages():
    sched, kv = make()
    r = req("a", 10)
    sched.add(r)
    sched.schedule(0.0)
    assert kv.num_free_pages < kv.allocator.num_usable
    sched.remove(r)
    assert kv.num_free_pages == kv.allocator.num_usable
    assert sched.num_unfinished == 0


def test_requests_rotating_in_hold_their_batch_rows():
    """max_num_seqs counts requests on their way back from the host: admitting new ones
    into those rows would overflow the largest compiled batch when the copies land."""
    from superinfer_jax.kv.two_tier import TwoTierKVManager

    cfg = EngineConfig(page_size=4, max_model_len=64, warmup=False, max_num_seqs=1,
                       num_host_pages=16)
    kv = TwoTierKVManager(32, cfg.page_size, 16)
    sched = make_scheduler(cfg, kv)
    a, b = req("a", 6), req("b", 6)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule(0.0)
    complete(sched, plan)
    sched.force_rotate_out.add("a")
    plan = sched.schedule(1.0)
    assert plan.rotate_out == ["a"]
    kv.finish_rotate_out("a")
    sched.on_rotated_out(a, 1.0)
    plan = sched.schedule(2.0)
    assert plan.rotate_in == ["a"] and plan.prefill == [] and plan.decode == []
    plan = sched.schedule(3.0)  # a still in flight: b must not take its row
    assert plan.prefill == [] and plan.decode == []
    assert len(sched.running) + sched._num_rotating_in() <= cfg.max_num_seqs


def test_every_prefill_call_has_a_shape_compiled_at_warm_up():
    """Random arrivals and lengths: the padded shape of every planned prefill call is one
    of ``config.prefill_shapes`` (the engine compiles exactly those), multi-row included."""
    import random

    rng = random.Random(0)
    sched, _ = make(num_pages=40, max_num_batched_tokens=64, max_prefill_chunk=64,
                    max_prefill_rows=4)
    cfg = sched.config
    compiled = set(cfg.prefill_shapes)
    assert compiled == {(1, 16), (1, 32), (1, 64), (4, 16)}
    seen = set()
    for step in range(400):
        for k in range(rng.choice((0, 0, 1, 3))):
            sched.add(req(f"r{step}.{k}", rng.randint(1, 56)))
        plan = sched.schedule(float(step))
        if plan.prefill:
            shape = (bucket(len(plan.prefill), cfg.prefill_row_buckets),
                     bucket(max(n for _, n in plan.prefill), cfg.prefill_chunk_buckets))
            assert shape in compiled, (shape, plan.prefill)
            seen.add(shape)
        complete(sched, plan)
        for r in [r for r in sched.running if len(r.output_token_ids) >= 8]:
            sched.remove(r)
    assert (4, 16) in seen and (1, 64) in seen
