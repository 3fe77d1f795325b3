"""FCFS scheduler plans on scripted requests, checked step by step (no model, no arrays)."""

from __future__ import annotations

from superinfer_jax.config import EngineConfig, bucket
from superinfer_jax.kv.page_allocator import KVCacheManager
from superinfer_jax.request import RequestStatus
from superinfer_jax.sched.rotasched.registry import make_scheduler
from tests.superinfer_jax.sched_kit import complete, make, req


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
    sched, kv = make(device_pages=9, max_num_batched_tokens=64, max_prefill_chunk=32)
    sched.add(req("big", 28))  # 7 pages of the 8 usable
    sched.add(req("small", 8))  # 2 pages: does not fit behind it
    sched.add(req("tiny", 2))  # would fit, but FCFS lets nobody overtake
    plan = sched.schedule(0.0)
    assert plan.prefill == [("big", 28)]
    assert [r.req_id for r in sched.waiting] == ["small", "tiny"]
    assert kv.num_free_pages == 1


def test_decode_out_of_pages_preempts_most_recent():
    sched, kv = make(device_pages=7, max_num_batched_tokens=64, max_prefill_chunk=32)
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

    cfg = EngineConfig.build(page_size=4, max_model_len=64, warmup=False, max_num_seqs=1,
                             num_host_pages=16)
    kv = TwoTierKVManager(32, cfg.hardware.page_size, 16)
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
    assert len(sched.running) + sched._num_rotating_in() <= cfg.engine.max_num_seqs


def test_every_prefill_call_has_a_shape_compiled_at_warm_up():
    """Random arrivals and lengths: the padded shape of every planned prefill call is one
    of ``config.prefill_shapes`` (the engine compiles exactly those), multi-row included."""
    import random

    rng = random.Random(0)
    sched, _ = make(device_pages=40, max_num_batched_tokens=64, max_prefill_chunk=64,
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


def test_plan_carries_the_shadows_the_engine_planned_itself():
    """``shadowing=True``: the plan's eager shadows are exactly what the engine used to
    plan after ``schedule`` (``kv.plan_shadows`` over the runners, within what the plan's
    rotate-outs left of the transfer budget, as DuplexKV.shadow_budget did), step by step,
    with forced rotations and a budget small enough to bind."""
    from superinfer_jax.kv.two_tier import TwoTierKVManager

    cfg = EngineConfig.build(page_size=4, max_model_len=64, warmup=False, policy="swap",
                             max_num_batched_tokens=32, max_prefill_chunk=16,
                             transfer_budget_pages=3, num_host_pages=64)
    twins = []
    for shadowing in (True, False):
        kv = TwoTierKVManager(24, cfg.hardware.page_size, 64)
        twins.append((make_scheduler(cfg, kv, shadowing=shadowing), kv))
    reqs = {s: [req(f"r{i}", 6 + 5 * i) for i in range(5)] for s, _ in twins}
    for s, _ in twins:
        for r in reqs[s]:
            s.add(r)
    shadowed = 0
    for step in range(40):
        plans = []
        for s, kv in twins:
            if step % 5 == 4 and s.running:
                s.force_rotate_out.add(s.running[0].req_id)
            plan = s.schedule(float(step))
            if not s.shadowing:
                room = max(0, cfg.duplex_kv.transfer_budget_pages
                           - sum(len(m) for m in plan.moves_out))
                computed = {r.req_id: r.num_computed_tokens for r in s.running}
                plan.shadows = kv.plan_shadows(computed, room)
            for rid in plan.rotate_out:
                kv.finish_rotate_out(rid)
                s.on_rotated_out(next(r for r in reqs[s] if r.req_id == rid), float(step))
            for rid in plan.rotate_in:
                kv.finish_rotate_in(rid)
                s.on_rotated_in(next(r for r in reqs[s] if r.req_id == rid), float(step))
            complete(s, plan)
            for r in [r for r in s.running if len(r.output_token_ids) >= 8]:
                s.remove(r)
            plans.append(plan)
        assert plans[0] == plans[1], step
        assert sum(len(m) for m in plans[0].shadows + plans[0].moves_out) \
            <= max(3, sum(len(m) for m in plans[0].moves_out))
        shadowed += sum(len(m) for m in plans[0].shadows)
    assert shadowed > 0 and twins[0][0].num_unfinished == 0


def test_no_shadows_without_a_host_tier_or_unless_asked():
    from superinfer_jax.kv.two_tier import TwoTierKVManager

    cfg = EngineConfig.build(page_size=4, max_model_len=64, warmup=False)
    for kv, shadowing in ((KVCacheManager(32, 4), True), (TwoTierKVManager(32, 4, 0), True),
                          (TwoTierKVManager(32, 4, 16), False)):
        sched = make_scheduler(cfg, kv, shadowing=shadowing)
        sched.add(req("a", 20))
        assert not sched.shadowing and sched.schedule(0.0).shadows == []
    sched = make_scheduler(cfg.replace(eager_shadowing=False), TwoTierKVManager(32, 4, 16),
                           shadowing=True)
    assert not sched.shadowing


def test_plan_records_the_budget_it_ran_under():
    sched, _ = make(max_num_batched_tokens=16, max_prefill_chunk=16,
                    transfer_budget_pages=5)
    sched.add(req("a", 20))
    plan = sched.schedule(0.0)
    assert (plan.budget.tokens, plan.budget.prefill_slots) == (16, 16)
    assert (plan.budget.pages_out, plan.budget.pages_in) == (5, 5)
    assert plan.num_tokens == 16
