"""Speculation is exact in bfloat16 too: the verify call's logits are bit for bit those
of decoding one token at a time, because it scores each position as a decode row
(``spec.verify.as_decode_rows``) and a decode row's bits do not depend on its batch
(native matmul and attention kernels, ``models.llama.row_sum`` for the norms). Logits
are checked on bfloat16 SmolLM2-135M (loaded once; its 30 layers turn XLA:CPU's
row-count-dependent reduction order into different bits, which a 2-layer random model
does not show), greedy tokens on a random bfloat16 Llama of SmolLM2's layer widths.
References: one-token decode steps of the same model, a float64 sum."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ModelConfig
from models.llama import row_sum
from models.servable import random_servable
from superinfer_jax import LLMEngine, SamplingParams
from superinfer_jax.kv.layout import PoolLayout
from superinfer_jax.model_api import StepInputs
from superinfer_jax.ops import native
from superinfer_jax.spec.verify import as_decode_rows
from tests.superinfer_jax.engine_testlib import SMALL, run_alone

WIDE = ModelConfig(name="tiny-wide", vocab_size=256, hidden_size=576, intermediate_size=1536,
                   num_layers=2, num_heads=9, num_kv_heads=3, head_dim=64,
                   max_position_embeddings=256, eos_token_ids=(255,))
PAGE, PAGES, COLS = 16, 8, 6  # 128 tokens a request


# The exactness is the native path's (batch-invariant kernels); XLA's dot, the path of a
# CPU without AVX512-BF16 or of native ops off, is not batch-invariant (docs/speculative.md)
needs_native = pytest.mark.skipif(
    not (native.bf16_matmul_available() and native.decode_attention_available()),
    reason="no native bf16 matmul or decode attention on this machine: XLA's dot is used")


@pytest.fixture(scope="module")
def bf16():
    return random_servable(WIDE, dtype="bfloat16", seed=2)


@pytest.fixture(scope="module")
def smollm2_bf16():
    from models import load_model

    return load_model("smollm2-135m", dtype="bfloat16")


def test_row_sum_is_the_sum_and_batch_invariant():
    rng = np.random.default_rng(0)
    for width in (64, 576, 100):  # 100: padded to whole lanes
        x = rng.standard_normal((18, width)).astype(np.float32)
        f = jax.jit(row_sum)
        full = np.asarray(f(jnp.asarray(x)))
        want = x.astype(np.float64).sum(-1, keepdims=True)
        # float32 sums of `width` terms: each add rounds once, |error| <= width * eps * sum|x|
        bound = width * np.finfo(np.float32).eps * np.abs(x).sum(-1, keepdims=True)
        assert (np.abs(full - want) <= bound).all()
        for rows in (1, 3, 7, 8, 18):
            assert (np.asarray(f(jnp.asarray(x[:rows]))) == full[:rows]).all(), (width, rows)


def _setup(model, lengths):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.vocab_size, n).tolist() for n in lengths]
    conts = rng.integers(0, model.vocab_size, (len(lengths), COLS))
    tables = 1 + np.arange(len(lengths) * PAGES, dtype=np.int32).reshape(len(lengths), PAGES)
    layout = PoolLayout(model.kv_spec, PAGE, "float32" if model.acc32 else model.dtype)
    step = jax.jit(lambda p, pool, x: model.forward(p, pool, x, return_hidden=True)[:2])

    def prefilled():
        pool = layout.zeros(1 + tables.size)
        for b, prompt in enumerate(prompts):
            n = len(prompt)
            x = StepInputs.from_numpy([prompt], np.arange(n)[None], [n], [n], tables[b:b + 1])
            pool = step(model.params, pool, x)[1]
        return pool

    positions = np.array([len(p) + np.arange(COLS) for p in prompts], np.int32)
    return prompts, conts, tables, positions, prefilled, step


@needs_native
def test_verify_logits_are_decode_logits_bit_for_bit(smollm2_bf16):
    """Three requests, six positions each: one 18-row verify pass == six decode steps."""
    bf16 = smollm2_bf16
    assert bf16.acc32  # the bfloat16 path: bfloat16 weights, float32 sums
    _, conts, tables, positions, prefilled, step = _setup(bf16, (60, 101, 90))
    rows = len(conts)
    pool, decoded = prefilled(), []
    for j in range(COLS):
        x = StepInputs.from_numpy(conts[:, j:j + 1], positions[:, j:j + 1], np.ones(rows),
                                  positions[:, j] + 1, tables)
        logits, pool = step(bf16.params, pool, x)
        decoded.append(np.asarray(logits))
    want = np.stack(decoded, 1)  # [rows, C, vocab]
    verify = StepInputs.from_numpy(conts, positions, np.full(rows, COLS),
                                   positions[:, -1] + 1, tables)
    got, verified_pool = step(bf16.params, prefilled(), jax.jit(as_decode_rows)(verify))
    np.testing.assert_array_equal(np.asarray(got).reshape(want.shape), want)
    np.testing.assert_array_equal(np.asarray(verified_pool), np.asarray(pool))  # same KV
    # a shorter row: its padding columns write the null page only and see nothing
    short = StepInputs.from_numpy(conts, positions, np.array([COLS, 2, 4]),
                                  positions[np.arange(rows), [COLS - 1, 1, 3]] + 1, tables)
    got = np.asarray(step(bf16.params, prefilled(), jax.jit(as_decode_rows)(short))[0])
    got = got.reshape(want.shape)
    for b, n in enumerate((COLS, 2, 4)):
        np.testing.assert_array_equal(got[b, :n], want[b, :n])


@needs_native
def test_a_decode_rows_bits_do_not_depend_on_its_batch(smollm2_bf16):
    """18 decode rows in one step (over a pool whose K/V they all see written) == each
    row alone."""
    bf16 = smollm2_bf16
    _, conts, tables, positions, prefilled, step = _setup(bf16, (60, 101, 90))
    tokens, pos = conts.reshape(-1, 1), positions.reshape(-1, 1)
    tables = tables.repeat(COLS, 0)
    x = StepInputs.from_numpy(tokens, pos, np.ones(18), pos[:, 0] + 1, tables)
    pool = step(bf16.params, prefilled(), x)[1]  # every row's K/V written
    batch = np.asarray(step(bf16.params, pool, x)[0])
    for i in range(18):
        alone = StepInputs.from_numpy(tokens[i:i + 1], pos[i:i + 1], [1], pos[i, :1] + 1,
                                      tables[i:i + 1])
        np.testing.assert_array_equal(np.asarray(step(bf16.params, pool, alone)[0])[0],
                                      batch[i])


def _batched(engine, prompts, sp):
    ids = [engine.add_request(p, sp) for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
    return [engine.release(r).output_token_ids for r in ids]


@pytest.fixture(scope="module")
def greedy_case(bf16):
    """Prompts with repeats (proposals taken and rejected) and plain decoding's tokens,
    batched (the reference every k compares with)."""
    rng = np.random.default_rng(3)
    prompts = [(rng.integers(0, 250, 5).tolist() * 4)[:int(n)] for n in (9, 13, 17)]
    prompts.append((rng.integers(0, 250, 3).tolist() * 8)[:20])
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    return prompts, sp, _batched(LLMEngine(bf16, SMALL), prompts, sp)


@needs_native
@pytest.mark.parametrize("k", [1, 3, 5])
def test_bf16_greedy_tokens_equal_with_speculation(bf16, greedy_case, k):
    prompts, sp, reference = greedy_case
    engine = LLMEngine(bf16, SMALL.replace(speculative_method="ngram",
                                           num_speculative_tokens=k))
    assert _batched(engine, prompts, sp) == reference
    assert run_alone(engine, prompts, sp) == reference
    spec = engine.stats().spec_decode
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
