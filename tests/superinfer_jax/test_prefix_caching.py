"""Prefix caching never changes output, and hits are real: greedy tokens with caching on
equal those of the same requests run alone on an engine with caching off, for repeated,
shared-prefix and multi-turn prompts (the second turn's prompt is the first turn's prompt,
its answer and a new message), under forced rotation and a device pool small enough to
reclaim cached pages and recompute, with async scheduling and without. Then isolation by
``cache_salt`` (on page ids), a page found by hash holding byte-exactly the KV written
when it was first computed, the one-token cap, and SmolLM2."""

from __future__ import annotations

import numpy as np
import pytest

from models.servable import random_servable
from superinfer_jax import LLMEngine, SamplingParams
from superinfer_jax.request import FieldError
from tests.superinfer_jax.engine_testlib import SMALL, TINY

SP = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    return random_servable(TINY, seed=1)


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
    (True, 0, 40), (False, 0, 40), (True, 3, 16), (False, 4, 16)])
def test_greedy_tokens_equal_with_caching_on(tiny, workload, async_scheduling, rotate_every,
                                             pages):
    first, ref_first, second, ref_second = workload
    engine = LLMEngine(tiny, SMALL.replace(async_scheduling=async_scheduling,
                                           num_device_pages=pages, num_host_pages=64))
    done = drain(engine, [engine.add_request(p, SP) for p in first], rotate_every)
    assert [r.output_token_ids for r in done] == ref_first
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


def test_salts_isolate_and_found_pages_hold_their_kv(tiny):
    engine = LLMEngine(tiny, SMALL.replace(num_device_pages=40))
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


def test_one_token_is_always_computed(tiny):
    """A prompt of exactly two pages, repeated: one page is a hit, the second is computed
    (its last token gives the first output token's logits)."""
    engine = LLMEngine(tiny, SMALL.replace(num_device_pages=40))
    prompt = list(range(60, 76))
    first = drain(engine, [engine.add_request(prompt, SP)])[0]
    again = drain(engine, [engine.add_request(prompt, SP)])[0]
    assert again.num_cached_tokens == 8
    assert again.output_token_ids == first.output_token_ids


def test_smollm2_greedy_tokens_equal_with_caching(smollm2):
    # the shapes of the SmolLM2 rotation test, so the persistent XLA cache serves both
    cfg = SMALL.replace(page_size=16, num_device_pages=8, num_host_pages=32)
    tok = smollm2.tokenizer
    system = tok.encode("You are a helpful assistant. Answer every question in one short "
                        "sentence, and never more. Question: ")
    prompts = [system + tok.encode(q) for q in ("What is the capital of France?",
                                                "What is the capital of Italy?")]
    off = LLMEngine(smollm2, cfg.replace(enable_prefix_caching=False))
    ref = [alone(off, p) for p in prompts]
    on = LLMEngine(smollm2, cfg)
    got = [drain(on, [on.add_request(p, SP)])[0] for p in prompts]
    assert [r.output_token_ids for r in got] == ref
    assert got[1].num_cached_tokens >= 16
