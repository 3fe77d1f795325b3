"""The rotation engine on real arrays: byte-exact round trips (float32, bfloat16, both
fp8 KV dtypes: their per-head scales are the engine's, fixed, so a page is its bytes) across
page reuse, same-step reuse of a freed page, transfer failures and a full host tier.

Both copy modes run here (``PageMover.copy_mode``): ``fused`` is what CPU engines use,
``device_put`` what GPU engines use, so the GPU path's bookkeeping is exercised on CPU."""

from __future__ import annotations

import numpy as np
import pytest

from superinfer_jax.duplexkv import COPY_MODES, EventKind, staging_buckets
from tests.superinfer_jax.duplexkv.rig_testlib import Rig, assert_bytes_equal


def test_default_copy_mode_is_fused_on_cpu():
    assert Rig("float32").duplex.mover.copy_mode == "fused"


@pytest.mark.parametrize("copy_mode", COPY_MODES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "fp8_e4m3", "fp8_e5m2"])
def test_round_trip_is_byte_exact_across_page_reuse(dtype, copy_mode):
    rig = Rig(dtype, copy_mode=copy_mode)
    rig.fill("a", 10)  # 3 pages, the last one partly filled
    rig.fill("b", 8)
    for i in range(6):
        req = "ab"[i % 2]
        tokens = 10 if req == "a" else 8
        rig.step(shadow_tokens={"a": 10, "b": 8} if i == 0 else None)
        rig.round_trip(req, tokens)
        assert_bytes_equal(rig.device_contents(req), rig.expect[req])
        rig.kv.check_invariants()
    assert [e.kind for e in rig.events].count(EventKind.ROTATED_IN) == 6
    assert rig.duplex.stats.shadow_pages > 0 and rig.duplex.stats.failures == 0


@pytest.mark.parametrize("copy_mode", COPY_MODES)
def test_many_random_round_trips_bfloat16(copy_mode):
    rig = Rig("bfloat16", num_pages=12, num_host_pages=20, seed=3, copy_mode=copy_mode)
    sizes = {"a": 5, "b": 12, "c": 3}
    for req, n in sizes.items():
        rig.fill(req, n)
    rng = np.random.default_rng(1)
    for _ in range(12):
        req = str(rng.choice(list(sizes)))
        rig.round_trip(req, sizes[req])
    for req in sizes:
        assert_bytes_equal(rig.device_contents(req), rig.expect[req])
    assert rig.duplex.stats.rotations_in == 12


@pytest.mark.parametrize("copy_mode", COPY_MODES)
def test_page_freed_by_rotate_out_reused_by_rotate_in_in_the_same_step(copy_mode):
    rig = Rig("float32", num_pages=4, copy_mode=copy_mode)  # 3 usable pages
    rig.fill("a", 8)  # 2 pages
    rig.round_trip("a", 8)  # a's copies now live on the host too
    rig.step(moves_out=[rig.kv.rotate_out("a", 8)])
    rig.settle()  # a is parked; its old pages are free
    rig.fill("b", 8)  # b takes two of them
    out_b = rig.kv.rotate_out("b", 8)
    in_a = rig.kv.rotate_in("a")  # ...and a reuses b's pages, freed in this same step
    assert set(in_a.device_pages) & set(out_b.device_pages)
    rig.step(moves_out=[out_b], moves_in=[in_a])
    rig.settle()
    assert_bytes_equal(rig.device_contents("a"), rig.expect["a"])
    rig.kv.free("a")  # a finishes; b comes back into the same pages
    rig.step(moves_in=[rig.kv.rotate_in("b")])
    rig.settle()
    assert_bytes_equal(rig.device_contents("b"), rig.expect["b"])


@pytest.mark.parametrize("copy_mode", COPY_MODES)
def test_failed_copy_is_reported_and_nothing_lands(monkeypatch, copy_mode):
    rig = Rig("float32", copy_mode=copy_mode)
    rig.fill("a", 8)
    rig.fill("b", 6)
    before = np.asarray(rig.pool)

    def broken(*args):
        raise RuntimeError("DMA engine on fire")

    monkeypatch.setattr(rig.duplex, "_copy_out", broken)
    rig.step(moves_out=[rig.kv.rotate_out("a", 8)], shadow_tokens={"b": 6})
    assert [(e.req_id, e.kind) for e in rig.events] == [("a", EventKind.FAILED)]
    assert not rig.kv.shadows  # the failed shadow copy is forgotten
    rig.kv.free("a")  # what the scheduler does: recompute a
    rig.kv.check_invariants()
    assert rig.duplex.stats.failures == 1
    np.testing.assert_array_equal(np.asarray(rig.pool), before)


@pytest.mark.parametrize("copy_mode", COPY_MODES)
def test_failed_inbound_copy_is_reported_and_nothing_lands(monkeypatch, copy_mode):
    rig = Rig("float32", copy_mode=copy_mode)
    rig.fill("a", 8)
    rig.step(moves_out=[rig.kv.rotate_out("a", 8)])
    rig.settle()
    rig.scribble()
    before = np.asarray(rig.pool)

    def broken(*args):
        raise RuntimeError("DMA engine on fire")

    monkeypatch.setattr(rig.duplex, "_copy_in", broken)
    rig.step(moves_in=[rig.kv.rotate_in("a")])
    rig.settle()
    assert [e.kind for e in rig.events] == [EventKind.ROTATED_OUT, EventKind.FAILED]
    assert rig.duplex.stats.failures == 1
    np.testing.assert_array_equal(np.asarray(rig.pool), before)


def test_error_observed_when_ready_fails_the_rotation(monkeypatch):
    rig = Rig("float32")
    rig.fill("a", 8)
    rig.step(moves_out=[rig.kv.rotate_out("a", 8)])
    monkeypatch.setattr("superinfer_jax.duplexkv.rotation._arrived", lambda arrays: False)
    rig.step()
    assert [e.kind for e in rig.events] == [EventKind.FAILED]


def test_cancel_drops_copies_and_the_host_pages_are_released():
    rig = Rig("float32")
    rig.fill("a", 8)
    rig.step(moves_out=[rig.kv.rotate_out("a", 8)])
    rig.kv.free("a")  # aborted while rotating out
    rig.duplex.cancel("a")
    assert rig.duplex.num_in_flight == 0 and rig.duplex.host.num_stored == 0
    rig.kv.check_invariants()


@pytest.mark.parametrize("copy_mode", COPY_MODES)
def test_staging_buckets_and_chunking(copy_mode):
    assert staging_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert staging_buckets(10) == (1, 2, 4, 8, 10)
    rig = Rig("float32", num_pages=9, budget=4, copy_mode=copy_mode)
    assert rig.duplex.mover._chunks(7) == [(0, 4), (4, 2), (6, 1)]  # exact, no padding
    assert rig.duplex.mover._chunks(9) == [(0, 4), (4, 4), (8, 1)]
    rig.fill("a", 30)  # 8 pages: two staging batches of 4
    rig.round_trip("a", 30)
    assert_bytes_equal(rig.device_contents("a"), rig.expect["a"])
    rig.kv.free("a")
    rig.fill("b", 10)  # 3 pages: batches of 2 and 1
    rig.round_trip("b", 10)
    assert_bytes_equal(rig.device_contents("b"), rig.expect["b"])
