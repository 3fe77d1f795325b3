"""Rotation never changes output: requests rotated out to the host and back (and
recomputed, when the device pool is too small for the batch) generate exactly the greedy
tokens they generate alone, with no memory pressure, on the same engine.

The reference runs each request alone on the same engine first, so both runs share the
compiled step shapes (a compile dominates these tests on CPU)."""

from __future__ import annotations

import numpy as np
import pytest

from superinfer_jax import LLMEngine, SamplingParams
from superinfer_jax.request import RequestStatus
from tests.superinfer_jax.engine_testlib import SMALL, SMOLLM2_SMALL, run_alone, run_rotating


# Within a weight quantization mode (models.quant) the same holds: int8 and W8A8 weights run
# through their own kernel, whose rows keep their bits whatever the batch.
@pytest.mark.parametrize("quantization", ["none", "int8", "w8a8_int8"])
def test_tiny_model_rotation_keeps_greedy_tokens(tiny, quantization):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 250, size=int(n)).tolist() for n in rng.integers(3, 30, 6)]
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    # 11 usable pages: one request needs up to 7, the batch about 30.
    engine = LLMEngine(tiny.quantized(quantization),
                       SMALL.replace(num_device_pages=12, num_host_pages=64))
    reference = run_alone(engine, prompts, sp)
    # again: the last prompts' full pages are still cached on the device (prefix hits)
    hits = engine.stats()["prefix_cache_hits"]
    assert run_alone(engine, prompts[-2:], sp) == reference[-2:]
    assert engine.stats()["prefix_cache_hits"] > hits
    done = run_rotating(engine, prompts, sp, every=4)
    assert [r.output_token_ids for r in done] == reference
    assert sum(r.num_rotations for r in done) >= 4
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in done)
    stats = engine.stats()
    # a request forced out while its final token is in flight finishes parked
    assert 4 <= stats["transfer_rotations_in"] <= stats["transfer_rotations_out"] \
        == sum(r.num_rotations for r in done)
    # the reference run left the prompts' pages cached: some come back from the host tier
    assert stats["transfer_prefix_hits_in"] > 0 and stats["prefix_cache_host_hits"] > 0
    assert stats["transfer_shadow_pages"] > 0
    assert stats["device_pages_free"] == 11 and stats["host_pages_free"] == 64


@pytest.mark.parametrize("quantization", ["none", "int8", "w8a8_int8"])
def test_without_host_tier_forced_rotation_recomputes(tiny, quantization):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 250, size=int(n)).tolist() for n in rng.integers(3, 30, 4)]
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    engine = LLMEngine(tiny.quantized(quantization), SMALL.replace(num_device_pages=10))
    assert engine.duplex is None
    reference = run_alone(engine, prompts, sp)
    done = run_rotating(engine, prompts, sp, every=2)
    assert [r.output_token_ids for r in done] == reference
    assert sum(r.num_rotations for r in done) == 0
    assert sum(r.num_preemptions for r in done) >= 2


@pytest.fixture(scope="module")
def few_prompts():
    rng = np.random.default_rng(2)
    return [rng.integers(0, 250, size=int(n)).tolist() for n in rng.integers(3, 30, 4)]


def test_transfer_failures_fall_back_to_recompute(tiny, few_prompts, monkeypatch):
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    engine = LLMEngine(tiny, SMALL.replace(num_device_pages=12, num_host_pages=64))
    reference = run_alone(engine, few_prompts, sp)
    calls = {"n": 0}

    def flaky(real):
        def copy(*args):
            calls["n"] += 1
            if calls["n"] % 3 == 0:
                raise RuntimeError("injected transfer failure")
            return real(*args)
        return copy

    for name in ("_copy_out", "_copy_in"):  # every copy, either way, may fail
        monkeypatch.setattr(engine.duplex, name, flaky(getattr(engine.duplex, name)))
    done = run_rotating(engine, few_prompts, sp, every=2)
    assert [r.output_token_ids for r in done] == reference
    assert engine.duplex.stats.failures > 0
    assert sum(r.num_preemptions for r in done) > 0


def test_full_host_pool_falls_back_to_recompute(tiny, few_prompts):
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    engine = LLMEngine(tiny, SMALL.replace(num_device_pages=12, num_host_pages=3,
                                           eager_shadowing=False))
    reference = run_alone(engine, few_prompts, sp)
    done = run_rotating(engine, few_prompts, sp, every=2)
    assert [r.output_token_ids for r in done] == reference
    assert sum(r.num_preemptions for r in done) > 0  # did not fit on the host
    assert engine.kv.num_host_unused_pages == 3  # free, or cached copies nobody needs


def test_abort_in_every_rotation_state_frees_both_tiers(tiny, few_prompts):
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    engine = LLMEngine(tiny, SMALL.replace(num_device_pages=12, num_host_pages=16))
    ids = [engine.add_request(p, sp) for p in few_prompts[:3]]
    seen = set()
    for step in range(100_000):
        engine.step()
        running = [r.req_id for r in engine.scheduler.running]
        if step % 2 == 0 and running:
            engine.force_rotate_out(running[0])
        for rid in ids:
            status = engine.requests[rid].status
            if status in (RequestStatus.ROTATING_OUT, RequestStatus.ROTARY,
                          RequestStatus.ROTATING_IN) and status not in seen:
                seen.add(status)
                engine.abort_request(rid)
                engine.kv.check_invariants()
        if not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests() and RequestStatus.ROTATING_OUT in seen
    engine.step()  # drops the host arrays of freed pages
    # every page is free or cached; the host keeps arrays only for cached copies
    assert engine.kv.num_free_pages == 11 and engine.kv.num_host_unused_pages == 16
    assert engine.duplex.num_in_flight == 0
    assert engine.duplex.host.num_stored == engine.kv.num_host_cached_pages

def test_smollm2_rotation_keeps_greedy_tokens(smollm2):
    """The real model: 6 requests, a pool that holds about two of them, rotations every
    few steps; each request's greedy tokens match its run alone."""
    model = smollm2
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there",
             "The three primary colors are", "Water boils at a temperature of",
             "import numpy as np\nx ="]
    prompts = [model.tokenizer.encode(t) for t in texts]
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    cfg = SMOLLM2_SMALL
    engine = LLMEngine(model, cfg)  # 7 usable pages; the batch needs 18
    reference = run_alone(engine, prompts, sp)
    done = run_rotating(engine, prompts, sp, every=3)
    assert [r.output_token_ids for r in done] == reference
    assert sum(r.num_rotations for r in done) >= 3
