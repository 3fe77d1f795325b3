"""``in_step`` copy mode: the page copies inside the model step's own program.

On real arrays, with a stand-in step shaped as ``ModelRunner``'s (land the arrived
pages, a KV write, gather the outbound pages): pages gathered in the step are byte-exact
copies of the pool before the step, in pinned_host memory, even when a rotate-in of the
same step reuses them; pages landed by the step are byte-exact and in the pool before
the step's own writes; a page the step writes is gathered before it, by the separate
program; the compiled step keeps the donated pool in place. Then the engine: greedy
tokens identical to the default mode under forced rotation, with copies taken by the
step."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from superinfer_jax import LLMEngine, SamplingParams
from superinfer_jax.duplexkv import EventKind
from superinfer_jax.duplexkv.mover import gather_in_step, land_in_step
from tests.superinfer_jax.duplexkv.rig_testlib import Rig, assert_bytes_equal
from tests.superinfer_jax.engine_testlib import SMALL, run_alone, run_rotating

JUNK = 7.0


def stand_in_step(rig: Rig):
    """A jitted 'model step' with in_step copies: land, then write ``JUNK`` to
    ``write_id`` (what a model's KV write does to a page of a running request), then
    gather; pool donated, gathered pages out in pinned_host, as ``ModelRunner``'s."""
    host = rig.duplex.host

    def step(pool, out_ids, in_ids, in_pages, write_id):
        pool = land_in_step(pool, in_ids, in_pages)
        junk = jax.numpy.full(pool.shape[1:], JUNK, pool.dtype)
        pool = jax.lax.dynamic_update_index_in_dim(pool, junk, write_id, 0)
        return pool, gather_in_step(pool, out_ids)

    return jax.jit(step, donate_argnums=(0,), out_shardings=(rig.pool.sharding,
                                                             host.host_sharding))


def run_step(rig: Rig, step, write_id: int, moves_out=(), moves_in=(),
             num_out: int | None = None, num_in: int | None = None) -> tuple[list, list]:
    """One engine step as the runner drives it in in_step mode: poll and execute
    deferred, then the step takes ``num_out`` / ``num_in`` pages (None: all it may).
    Returns the step's gathered pages and its landed page ids."""
    rig.pool, events = rig.duplex.poll(rig.pool, defer=True)
    events += rig.duplex.execute(rig.pool, list(moves_out), list(moves_in), [], defer=True)
    may_out, may_in = rig.duplex.in_step_pending({write_id})
    rig.pool, copies = rig.duplex.take_in_step(
        rig.pool, may_out if num_out is None else num_out,
        may_in if num_in is None else num_in, {write_id})
    assert write_id not in copies.out_ids.tolist()
    assert not rig.duplex.has_deferred
    rig.pool, out_pages = step(rig.pool, copies.out_ids, copies.in_ids, copies.in_pages,
                               np.int32(write_id))
    events += rig.duplex.finish_in_step(out_pages)
    rig.events += events
    return list(out_pages), copies.in_ids.tolist()


def host_contents(rig: Rig, req_id: str) -> np.ndarray:
    return np.stack([np.asarray(p) for p in rig.duplex.host.get(rig.kv.host_table(req_id))])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("land", ["in_step", "separate"])
def test_step_copies_are_byte_exact_across_same_step_reuse(dtype, land):
    rig = Rig(dtype, num_pages=6, copy_mode="in_step")  # 5 usable pages
    step = stand_in_step(rig)
    rig.fill("a", 8)  # 2 pages
    rig.round_trip("a", 8)  # a's copies live on the host
    rig.step(moves_out=[rig.kv.rotate_out("a", 8)])
    rig.settle()  # a parked, its pages free
    rig.fill("b", 12)  # 3 pages
    rig.fill("c", 4)  # 1 page: the running request whose page the steps write
    c_page = rig.kv.page_table("c")[0]
    out_b = rig.kv.rotate_out("b", 12)
    in_a = rig.kv.rotate_in("a")  # a lands in pages b leaves, reserved in this step
    assert set(in_a.device_pages) & set(out_b.device_pages)
    out_pages, landed = run_step(rig, step, c_page, [out_b], [in_a])
    assert len(out_pages) == 3 and not landed  # b gathered in the step; a not arrived
    for page, want in zip(out_pages, rig.expect["b"], strict=True):
        assert page.sharding.memory_kind == rig.duplex.host.memory_kind
        assert_bytes_equal(np.asarray(page), want)
    # the next step: a's pages arrived, landed first thing (by the step or before it)
    _, landed = run_step(rig, step, c_page, num_in=None if land == "in_step" else 0)
    assert sorted(landed) == (sorted(in_a.device_pages) if land == "in_step" else [])
    assert rig.duplex.stats.pages_in_step == 3 + len(landed)
    assert {e.kind for e in rig.events[-2:]} == {EventKind.ROTATED_OUT, EventKind.ROTATED_IN}
    assert_bytes_equal(host_contents(rig, "b"), rig.expect["b"])
    assert_bytes_equal(rig.device_contents("a"), rig.expect["a"])
    assert np.all(np.asarray(rig.pool[c_page]) == JUNK)
    rig.kv.free("a")
    rig.step(moves_in=[rig.kv.rotate_in("b")])
    rig.settle()
    assert_bytes_equal(rig.device_contents("b"), rig.expect["b"])
    assert rig.duplex.stats.failures == 0
    rig.kv.check_invariants()


def test_a_page_the_step_writes_is_gathered_before_it():
    rig = Rig("float32", copy_mode="in_step")
    step = stand_in_step(rig)
    rig.fill("a", 8)  # 2 pages
    first = rig.kv.page_table("a")[0]
    # as if the step reused a's first page for a running row (it writes JUNK there)
    out_pages, _ = run_step(rig, step, first, [rig.kv.rotate_out("a", 8)])
    assert len(out_pages) == 1  # the other page; the first went by the separate gather
    rig.settle()
    assert_bytes_equal(host_contents(rig, "a"), rig.expect["a"])
    assert np.all(np.asarray(rig.pool[first]) == JUNK)


def test_a_page_landed_by_the_step_is_in_the_pool_before_its_writes():
    """The step lands first: its own write of ``JUNK`` to a page it just landed (a KV
    write into a page it was given) is what the pool holds after it."""
    rig = Rig("float32", num_pages=4, copy_mode="in_step")
    step = stand_in_step(rig)
    rig.fill("a", 4)  # 1 page
    rig.step(moves_out=[rig.kv.rotate_out("a", 4)])
    rig.settle()
    in_a = rig.kv.rotate_in("a")
    run_step(rig, step, 0, moves_in=[in_a])  # issued; arrives by the next poll
    _, landed = run_step(rig, step, in_a.device_pages[0])
    assert landed == list(in_a.device_pages)
    assert np.all(np.asarray(rig.pool[in_a.device_pages[0]]) == JUNK)
    assert rig.events[-1].kind == EventKind.ROTATED_IN


@pytest.mark.parametrize("land", ["in_step", "separate"])
@pytest.mark.parametrize("gather", ["in_step", "separate"])
def test_a_page_that_lands_and_leaves_in_one_step_leaves_with_what_landed(land, gather):
    """A request made runnable by a step's poll and rotated out again by the same step's
    plan: its pages are gathered after they landed, whichever program does either."""
    rig = Rig("float32", copy_mode="in_step")
    step = stand_in_step(rig)
    rig.fill("a", 8)  # 2 pages
    rig.step(moves_out=[rig.kv.rotate_out("a", 0)])  # 0: no host copy stays a shadow
    rig.settle()
    rig.scribble()  # the freed pages hold junk until a's pages land again
    run_step(rig, step, 0, moves_in=[rig.kv.rotate_in("a")])  # issued; arrives next poll
    rig.pool, events = rig.duplex.poll(rig.pool, defer=True)
    assert [e.kind for e in events] == [EventKind.ROTATED_IN]  # runnable, not landed yet
    pages = rig.kv.page_table("a")
    moves = rig.kv.rotate_out("a", 0)  # no shadows: both pages move
    assert sorted(moves.device_pages) == sorted(pages)
    rig.duplex.execute(rig.pool, [moves], [], [], defer=True)
    written = set(pages) if gather == "separate" else {0}
    num_out, num_in = rig.duplex.in_step_pending(written)
    # gathered before the call, they must land before it too
    assert (num_out, num_in) == ((0, 0) if gather == "separate" else (2, 2))
    rig.pool, copies = rig.duplex.take_in_step(rig.pool, num_out,
                                               num_in if land == "in_step" else 0, written)
    assert len(copies.in_ids) == (2 if land == gather == "in_step" else 0)
    rig.pool, out_pages = step(rig.pool, copies.out_ids, copies.in_ids, copies.in_pages,
                               np.int32(0))
    rig.events += rig.duplex.finish_in_step(out_pages)
    rig.settle()
    assert rig.events[-1].kind == EventKind.ROTATED_OUT
    assert_bytes_equal(host_contents(rig, "a"), rig.expect["a"])


def test_copies_not_taken_by_a_step_are_flushed():
    rig = Rig("float32", copy_mode="in_step")
    rig.fill("a", 8)
    rig.pool, _ = rig.duplex.poll(rig.pool)
    first = rig.kv.page_table("a")[0]
    rig.duplex.execute(rig.pool, [rig.kv.rotate_out("a", 8)], [], [], defer=True)
    assert rig.duplex.in_step_pending() == (2, 0)
    assert rig.duplex.in_step_pending({first}) == (1, 0)  # a step writing it: not in it
    rig.pool, events = rig.duplex.flush(rig.pool)
    assert events == [] and not rig.duplex.has_deferred
    rig.settle()
    assert_bytes_equal(host_contents(rig, "a"), rig.expect["a"])


def test_failed_copy_in_a_step_fails_the_batch(monkeypatch):
    rig = Rig("float32", copy_mode="in_step")
    step = stand_in_step(rig)
    rig.fill("a", 8)

    def broken(*args):
        raise RuntimeError("DMA engine on fire")

    monkeypatch.setattr(rig.duplex, "_copy_out", broken)
    run_step(rig, step, 0, [rig.kv.rotate_out("a", 8)])
    assert [(e.req_id, e.kind) for e in rig.events] == [("a", EventKind.FAILED)]
    assert rig.duplex.stats.failures == 1 and rig.duplex.num_in_flight == 0


def test_compiled_step_keeps_the_pool_in_place():
    """No pool-sized copy in the step: the gather reads the pool after the step's last
    write (a gather first would cost two copies of the pool per step on XLA:CPU)."""
    rig = Rig("float32", num_pages=9, copy_mode="in_step")
    step = stand_in_step(rig)
    page = jax.ShapeDtypeStruct(rig.pool.shape[1:], rig.pool.dtype,
                                sharding=rig.duplex.host.host_sharding)
    ids = np.zeros(2, np.int32)
    hlo = step.lower(rig.pool, ids, ids, (page, page), np.int32(0)).compile().as_text()
    pool_type = f"f32[{','.join(map(str, rig.pool.shape))}]"
    copies = [line for line in hlo.splitlines() if " copy(" in line and pool_type in line]
    assert not copies, copies


def test_in_step_mode_keeps_greedy_tokens(tiny):
    """Two pages per in-step copy: batches of two ride the step, a lone page waiting
    goes by the separate programs (both paths in one run; each in_step_pages value
    compiles its own step variants, so one value keeps the suite short)."""
    in_step_pages = 2
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 250, size=int(n)).tolist() for n in rng.integers(3, 30, 6)]
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    cfg = SMALL.replace(num_device_pages=12, num_host_pages=64)
    reference = run_alone(LLMEngine(tiny, cfg.replace(copy_mode="fused")), prompts, sp)
    engine = LLMEngine(tiny, cfg.replace(copy_mode="in_step", in_step_pages=in_step_pages))
    done = run_rotating(engine, prompts, sp, every=4)
    assert [r.output_token_ids for r in done] == reference
    assert sum(r.num_rotations for r in done) >= 4
    assert engine.duplex.stats.pages_in_step > 0  # some copies rode the step
    assert engine.duplex.stats.failures == 0
    stats = engine.stats()
    assert stats["device_pages_free"] == 11 and stats["host_pages_free"] == 64
    # the engine's stats report the in-step copies (a part of all copies made)
    assert 0 < stats["transfer_pages_in_step"] == engine.duplex.stats.pages_in_step
    assert stats["transfer_pages_in_step"] <= stats["transfer_pages_out"] + stats[
        "transfer_pages_in"]
