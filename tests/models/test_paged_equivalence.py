"""The paged path equals the contiguous one: pages scattered across the pool in random
order, prefill cut into odd chunks, several requests in one batch, all give the logits of
one one-shot forward over contiguous pages."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from models.config import ModelConfig, RopeScaling
from models.servable import random_servable
from superinfer_jax.kv.layout import PoolLayout
from superinfer_jax.model_api import StepInputs
from tests.numerics import assert_close, assert_same_top1, logits_tolerance

CFG = ModelConfig(name="paged-test", vocab_size=512, hidden_size=96, intermediate_size=192,
                  num_layers=2, num_heads=6, num_kv_heads=2, head_dim=16,
                  rope_scaling=RopeScaling(factor=4.0, original_max_position_embeddings=32))
PAGE = 8


@pytest.fixture(scope="module")
def model():
    return random_servable(CFG, seed=3)


@pytest.fixture(scope="module")
def step(model):
    return jax.jit(lambda p, pool, x: model.forward(p, pool, x, all_logits=True),
                   donate_argnums=(1,))


def run_chunks(model, step, prompts, chunks, rng):
    """Prefill every prompt in the given chunk sizes, all rows in one batch per step, with
    each request's pages drawn at random from a shared pool. Returns per-prompt logits."""
    layout = PoolLayout(model.kv_spec, PAGE, "float32")
    pages_each = [layout.pages_for_tokens(len(p)) for p in prompts]
    pool_pages = rng.permutation(np.arange(1, sum(pages_each) + 1))
    tables = np.zeros((len(prompts), max(pages_each)), np.int32)
    start = 0
    for i, n in enumerate(pages_each):
        tables[i, :n] = pool_pages[start:start + n]
        start += n
    pool = layout.zeros(sum(pages_each) + 1)
    done = [0] * len(prompts)
    out = [[] for _ in prompts]
    width = max(chunks)
    while any(d < len(p) for d, p in zip(done, prompts, strict=True)):
        tokens = np.zeros((len(prompts), width), np.int32)
        positions = np.zeros_like(tokens)
        qlens = np.zeros(len(prompts), np.int32)
        for i, p in enumerate(prompts):
            n = min(chunks[i % len(chunks)], len(p) - done[i])
            tokens[i, :n] = p[done[i]:done[i] + n]
            positions[i, :n] = np.arange(done[i], done[i] + n)
            qlens[i] = n
        ctx = np.array(done) + qlens
        logits, pool = step(model.params, pool,
                            StepInputs.from_numpy(tokens, positions, qlens, ctx, tables))
        logits = np.asarray(logits)
        for i in range(len(prompts)):
            out[i].append(logits[i, :qlens[i]])
            done[i] += int(qlens[i])
    return [np.concatenate(o) for o in out]


def test_shuffled_pages_and_odd_chunks_equal_one_shot(model, step):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 512, size=n).tolist() for n in (1, 8, 9, 23, 40)]
    # One shot each, padded to one width (attention is causal: the filler after a
    # prompt never reaches its logits), so one compiled shape instead of one per length.
    width = max(map(len, prompts))
    want = [model.logits(p + [0] * (width - len(p)), page_size=PAGE)[:len(p)]
            for p in prompts]
    for chunks in ([3], [5, 7], [1], [13, 2, 11]):
        got = run_chunks(model, step, prompts, chunks, rng)
        for w, g in zip(want, got, strict=True):
            # Batched odd chunks vs one request in one shot: other shapes, other summation
            # order (per CPU model, too), so the float32 bound of the model's logits.
            tol = logits_tolerance(CFG, w, len(w))
            what = f"chunks {chunks}, prompt of {len(w)}"
            assert_close(g, w, tol, what)
            assert_same_top1(g, w, tol, what)


def test_one_shot_page_size_does_not_matter(model):
    ids = np.random.default_rng(1).integers(0, 512, size=37)
    a = model.logits(ids, page_size=8)
    b = model.logits(ids, page_size=32, chunk_size=6)
    # Other page size and chunks: other attention blocks and matmul shapes (see above).
    tol = logits_tolerance(CFG, a, ids.size)
    assert_close(b, a, tol, "page 32, chunks of 6 vs page 8, one shot")
    assert_same_top1(b, a, tol, "page 32, chunks of 6 vs page 8, one shot")
