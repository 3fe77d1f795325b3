"""Every policy, driven by real memory pressure (no test hooks), generates exactly the
greedy tokens of each request run alone: rotasched and swap by rotating, fcfs by
recomputing. On a tiny random model and on the real SmolLM2.

The reference runs every prompt alone, one after another, in an engine with the same
pool and buckets as the pressured ones (one prompt always fits), so it compiles nothing
they do not also run, and it is computed once per model for the three policies."""

from __future__ import annotations

import numpy as np
import pytest

from superinfer_jax import LLMEngine, SamplingParams
from superinfer_jax.config import RotaSchedConfig
from superinfer_jax.request import SLO
from tests.superinfer_jax.engine_testlib import SMALL, SMOLLM2_SMALL, run_alone

# Tight SLOs make lag grow quickly, so rotasched rotates a lot.
TIGHT = SLO(ttft_ms=20, tbt_ms=5)


_ALONE: dict[str, list[list[int]]] = {}


def alone(key: str, model, prompts, sp, config) -> list[list[int]]:
    """Each prompt's greedy tokens with the engine to itself (no pressure, no batch), in
    the pressured engines' shapes; memoised under ``key`` for the module."""
    if key not in _ALONE:
        _ALONE[key] = run_alone(LLMEngine(model, config.replace(policy="fcfs")), prompts, sp)
    return _ALONE[key]


def constrained(model, prompts, sp, config):
    engine = LLMEngine(model, config)
    ids = [engine.add_request(p, sp, slo=TIGHT) for p in prompts]
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        engine.kv.check_invariants()
        steps += 1
        assert steps < 200_000, "no progress"
    done = [engine.release(i) for i in ids]
    stats = engine.stats()
    assert stats["device_pages_free"] == engine.kv.allocator.num_usable
    return done


@pytest.mark.parametrize("policy", ["fcfs", "swap", "rotasched"])
def test_tiny_model_under_pressure(tiny, policy):
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 250, size=int(n)).tolist() for n in rng.integers(3, 30, 8)]
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    cfg = SMALL.replace(num_device_pages=12, num_host_pages=128, policy=policy,
                        rotasched=RotaSchedConfig(high_water_mark=0.5))
    want = alone("tiny", tiny, prompts, sp, cfg)
    done = constrained(tiny, prompts, sp, cfg)
    assert [r.output_token_ids for r in done] == want
    if policy == "fcfs":
        assert sum(r.num_preemptions for r in done) > 0
        assert sum(r.num_rotations for r in done) == 0
    else:
        assert sum(r.num_rotations for r in done) > 0


@pytest.mark.parametrize("policy", ["swap", "rotasched", "fcfs"])
def test_smollm2_under_pressure(smollm2, policy):
    rng = np.random.default_rng(6)
    prompts = [rng.integers(10, 49000, size=int(n)).tolist() for n in (9, 30, 17, 41, 5, 24)]
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    cfg = SMOLLM2_SMALL.replace(num_host_pages=64, policy=policy,
                                rotasched=RotaSchedConfig(high_water_mark=0.5))
    want = alone("smollm2", smollm2, prompts, sp, cfg)
    done = constrained(smollm2, prompts, sp, cfg)
    assert [r.output_token_ids for r in done] == want
    moved = sum(r.num_rotations + r.num_preemptions for r in done)
    assert moved > 0
