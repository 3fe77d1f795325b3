"""Model and engine configs, and engine drivers, shared by the engine-level tests.

The rotation and policy invariance tests compare token streams of the same tiny random
model under different memory pressure; they share these so that a change to the model or
to the compiled step shapes reaches both (and the persistent XLA cache serves both). The
``tiny`` fixture (``tests/conftest.py``) is ``TINY`` with random weights.
"""

from __future__ import annotations

import numpy as np

from models.config import ModelConfig
from models.servable import random_servable
from superinfer_jax import EngineConfig, SamplingParams

TINY = ModelConfig(name="tiny", vocab_size=256, hidden_size=64, intermediate_size=128,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                   max_position_embeddings=256, eos_token_ids=(255,))
# Few compiled shapes: decode 1/2/4 rows, prefill 1 row x 16 columns.
SMALL = EngineConfig.build(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                           max_prefill_chunk=16, max_prefill_rows=1, page_size=8,
                           show_progress=False, warmup=False)
# The engine tests' shapes (test_engine, test_async_scheduling): 16 rows, 64-token prefills.
# warmup=False: each engine compiles only the shapes it runs, on first use (warm-up itself
# is tested in test_compilation and by every server the serving tests start).
BASE = EngineConfig.build(max_model_len=128, max_num_seqs=16, max_num_batched_tokens=64,
                          max_prefill_chunk=64, page_size=8, show_progress=False, warmup=False)
# SMALL for the real SmolLM2 (30 layers, about 7 s per compiled step program): every
# SmolLM2 engine test (rotation, policy and prefix-cache invariance) uses these shapes,
# so the persistent XLA cache compiles them once per suite run. 7 usable pages of 16.
SMOLLM2_SMALL = SMALL.replace(page_size=16, num_device_pages=8, num_host_pages=32)


# For tiny random models over a real 49,152-token vocabulary (``tiny_with_tokenizer``):
# structured outputs, the offline LLM API. One config for all of them, so the persistent
# XLA cache serves each step shape once: decode 1/2/4 rows, prefill 1 row x 16 (longer
# prompts in chunks of 16: one prefill shape, the tail of one token is a decode row).
VOCAB_CONFIG = EngineConfig.build(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
                                  max_prefill_chunk=16, max_prefill_rows=1, page_size=16,
                                  show_progress=False, num_device_pages=96, num_host_pages=96,
                                  warmup=False)  # compile only the shapes the requests run


class CharTokenizer:
    """One token, one letter: text is easy to predict, so stop strings are testable."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 32 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(32 + (i % 95)) for i in ids)


def tiny_with_tokenizer(tokenizer, seed: int = 0, **fields):
    """A tiny random Llama (2 layers, hidden 64) over ``tokenizer``'s vocabulary (SmolLM2's
    from the ``smollm2_tokenizer`` fixture), with its EOS ids and chat template;
    ``fields`` override ``ModelConfig`` fields (the servers' model: its name, BOS id and
    a longer context)."""
    config = ModelConfig(**{
        "name": "tiny-smollm2-vocab", "vocab_size": tokenizer.vocab_size, "hidden_size": 64,
        "intermediate_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
        "head_dim": 16, "max_position_embeddings": VOCAB_CONFIG.model.max_model_len,
        "tie_word_embeddings": True, "eos_token_ids": tuple(tokenizer.eos_token_ids),
        **fields})
    return random_servable(config, seed=seed, tokenizer=tokenizer)


SPEC_SAMPLING = SamplingParams(max_tokens=24, ignore_eos=True)
"""The speculation tests' requests (``spec_reference`` in ``conftest``): greedy, 24 tokens."""


def repeating_prompts() -> list[list[int]]:
    """Prompts with repeats (proposals a target takes and rejects), one without, and two
    longer than a 16-token prefill chunk (chunked prefill): the speculation tests'."""
    rng = np.random.default_rng(3)
    out = [(rng.integers(0, 250, 5).tolist() * 3)[:int(n)] for n in (9, 13, 15)]
    out += [rng.integers(0, 250, 7).tolist(), (rng.integers(0, 250, 6).tolist() * 6)[:34]]
    return out


def run_batched(engine, prompts, sp):
    """Every prompt at once, the pool's invariants checked after each step; the finished
    requests in prompt order."""
    ids = [engine.add_request(p, sp) for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
        engine.kv.check_invariants()
    return [engine.release(r) for r in ids]


def run_alone(engine, prompts, sp) -> list[list[int]]:
    """Each prompt's tokens with the engine to itself, one after another: the reference
    of the invariance tests (no batch, and no pressure: one request always fits their
    pools, which this asserts)."""
    out = []
    for p in prompts:
        rid = engine.add_request(p, sp)
        while engine.has_unfinished_requests():
            engine.step()
        done = engine.release(rid)
        assert done.num_preemptions == done.num_rotations == 0
        out.append(done.output_token_ids)
    return out


def run_rotating(engine, prompts, sp, every: int) -> list:
    """All requests at once; every ``every`` steps one of the running requests (when more
    than one runs) rotates out."""
    ids = [engine.add_request(p, sp) for p in prompts]
    step = 0
    while engine.has_unfinished_requests():
        engine.step()
        engine.kv.check_invariants()
        step += 1
        assert step < 100_000, "no progress"  # steps that only poll copies are quick
        running = [r.req_id for r in engine.scheduler.running]
        if step % every == 0 and len(running) > 1:
            engine.force_rotate_out(running[step % len(running)])
    return [engine.release(rid) for rid in ids]


def run_jobs(engine, jobs, rotate_every: int = 0) -> list:
    """Run ``(prompt, sampling)`` jobs to the end and release them (finished requests, in
    order); with ``rotate_every``, every job still running is forced out that often."""
    ids = [engine.add_request(p, sp) for p, sp in jobs]
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if rotate_every and steps % rotate_every == 0:
            for rid in ids:
                engine.force_rotate_out(rid)
    return [engine.release(rid) for rid in ids]


def drain_prefilled(engine) -> int:
    """Step ``engine`` until nothing is unfinished; the prompt tokens it prefilled (what a
    prefix hit saves shows here)."""
    prefilled = 0
    while engine.has_unfinished_requests():
        engine.step()
        prefilled += engine.last_stats.num_prefill_tokens
    return prefilled
