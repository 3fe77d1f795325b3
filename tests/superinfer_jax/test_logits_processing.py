"""Logits processing on the device against a plain numpy reference on scripted logits,
and end to end in the engine: penalties, logit_bias and min_tokens change tokens the way
they should, and the same way under async scheduling and rotation.

The reference follows vLLM's documented order: logit_bias, min_tokens (EOS and stop ids
masked), the grammar mask, then the repetition penalty over prompt and output (divide a
positive logit, multiply a negative one), then frequency (times the output count) and
presence (once per output token seen). Each value is one float32 operation on a
scripted logit, so the comparison is to float32 rounding of that one operation.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from superinfer_jax import LLMEngine, SamplingParams
from superinfer_jax.model_api import StepInputs
from superinfer_jax.runner.logits import (
    BIAS_WIDTH,
    NO_TOKEN,
    mask_words,
    neutral_logits_inputs,
    process_logits,
)
from tests.superinfer_jax.engine_testlib import SMALL, TINY, run_jobs

VOCAB, HIST, COLS, EOS = 40, 24, 4, (39,)


def _reference(logits, history, prompt_len, context_len, presence, frequency, repetition,
               bias, suppress_eos, allowed):
    """One row, numpy float64 then cast: ``history`` lists every token at positions
    ``0..context_len-1`` (what the device assembles from history + the step's inputs)."""
    x = logits.astype(np.float64).copy()
    for token, value in bias:
        x[token] += value
    if suppress_eos:
        x[list(EOS)] = -np.inf
    if allowed is not None:
        x[~allowed] = -np.inf
    seen = set(history[:context_len])
    outputs = history[prompt_len:context_len]
    for t in seen:
        x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
    for t in set(outputs):
        x[t] -= frequency * outputs.count(t) + presence
    return x


def test_process_logits_matches_numpy_reference():
    rng = np.random.default_rng(0)
    batch = 6
    logits = rng.normal(0, 3, (batch, VOCAB)).astype(np.float32)
    li = neutral_logits_inputs(batch, COLS, HIST, VOCAB)
    tokens = np.zeros((batch, COLS), np.int32)
    positions = np.zeros((batch, COLS), np.int32)
    context = np.zeros(batch, np.int32)
    cases = []
    for b in range(batch):
        start, n = int(rng.integers(3, 15)), int(rng.integers(1, COLS + 1))
        seq = rng.integers(0, VOCAB - 1, start + n).tolist()
        prompt_len = int(rng.integers(1, start + 1))
        li.history[b, :start] = seq[:start]
        tokens[b, :n] = seq[start:]
        positions[b, :n] = np.arange(start, start + n)
        context[b] = start + n
        li.prompt_lens[b] = prompt_len
        pres, freq, rep = [(0.0, 0.0, 1.0), (0.5, 0.0, 1.0), (0.0, 0.7, 1.0),
                           (0.0, 0.0, 1.3), (-0.4, 0.3, 0.8), (1.1, -0.5, 1.7)][b]
        li.presence[b], li.frequency[b], li.repetition[b] = pres, freq, rep
        bias = [(int(t), float(v)) for t, v in zip(rng.choice(VOCAB, 3, replace=False),
                                                    rng.normal(0, 5, 3), strict=True)]
        li.bias_ids[b, :3] = [t for t, _ in bias]
        li.bias_values[b, :3] = [v for _, v in bias]
        li.suppress_eos[b] = b % 2 == 0
        allowed = None
        if b in (1, 4):
            allowed = rng.random(VOCAB) < 0.5
            words = np.zeros(mask_words(VOCAB), np.uint32)
            for t in np.flatnonzero(allowed):
                words[t // 32] |= np.uint32(1) << np.uint32(t % 32)
            li.mask[b] = words.view(np.int32)
            li.masked[b] = True
        cases.append((seq, prompt_len, start + n, pres, freq, rep, bias, b % 2 == 0, allowed))
    # padding columns (token 0 at position 0) must not count: query_lens cuts them
    inputs = StepInputs.from_numpy(tokens, positions, context - positions[:, 0], context,
                                   np.zeros((batch, 1)))
    fn = jax.jit(process_logits, static_argnums=(3,))
    got = np.asarray(fn(logits, inputs, li, EOS))
    for b, (seq, prompt_len, ctx, pres, freq, rep, bias, sup, allowed) in enumerate(cases):
        want = _reference(logits[b], seq, prompt_len, ctx, pres, freq, rep, bias, sup, allowed)
        finite = np.isfinite(want)
        np.testing.assert_array_equal(np.isfinite(got[b]), finite, err_msg=f"row {b} masks")
        # a few float32 operations on values of magnitude ~|logit| + |bias| + penalties
        tol = 8 * np.finfo(np.float32).eps * (np.max(np.abs(want[finite])) + 1)
        np.testing.assert_allclose(got[b][finite], want[finite], rtol=0, atol=tol,
                                   err_msg=f"row {b}")


def test_neutral_inputs_change_nothing():
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 3, (3, VOCAB)).astype(np.float32)
    li = neutral_logits_inputs(3, COLS, HIST, VOCAB)
    assert li.bias_ids.shape == (3, BIAS_WIDTH) and (li.history == NO_TOKEN).all()
    z = np.zeros((3, COLS), np.int32)
    inputs = StepInputs.from_numpy(z, z, np.full(3, COLS), np.full(3, 4), np.zeros((3, 1)))
    got = jax.jit(process_logits, static_argnums=(3,))(logits, inputs, li, EOS)
    np.testing.assert_array_equal(np.asarray(got), logits)


# -- end to end on the tiny random model ------------------------------------------------

def _generate(engine: LLMEngine, prompts, sampling, rotate_every: int = 0):
    done = run_jobs(engine, [(p, sampling) for p in prompts], rotate_every)
    return [r.output_token_ids for r in done]


PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 20, 21, 20], [100, 3, 3, 3, 3, 3, 3]]


@pytest.fixture(scope="module")
def engines(tiny):
    # SMALL's own device pool, so the step shapes are those of the other SMALL engines
    # (compiled once per suite through the XLA cache); host pages for the rotations
    base = SMALL.replace(num_host_pages=64)
    return {"sync": LLMEngine(tiny, base.replace(async_scheduling=False)),
            "async": LLMEngine(tiny, base.replace(async_scheduling=True))}


def test_penalties_under_async_and_rotation_give_the_same_tokens(engines):
    sp = SamplingParams(max_tokens=20, ignore_eos=True, presence_penalty=1.5,
                        frequency_penalty=0.8, repetition_penalty=1.4)
    plain = _generate(engines["sync"], PROMPTS, dataclasses.replace(
        sp, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0))
    want = _generate(engines["sync"], PROMPTS, sp)
    assert want != plain  # the penalties do something on this model
    # a strong frequency penalty spreads the output over more distinct tokens
    assert sum(len(set(w)) for w in want) > sum(len(set(p)) for p in plain)
    assert _generate(engines["async"], PROMPTS, sp) == want
    assert _generate(engines["async"], PROMPTS, sp, rotate_every=3) == want


def test_logit_bias_forces_and_bans_tokens(engines):
    forced = _generate(engines["async"], PROMPTS[:2],
                       SamplingParams(max_tokens=5, ignore_eos=True, logit_bias={77: 100.0}))
    assert forced == [[77] * 5, [77] * 5]
    plain = _generate(engines["sync"], PROMPTS[:1], SamplingParams(max_tokens=8,
                                                                   ignore_eos=True))[0]
    banned = _generate(engines["sync"], PROMPTS[:1], SamplingParams(
        max_tokens=8, ignore_eos=True, logit_bias={plain[0]: -100.0}))[0]
    assert plain[0] not in banned[:1]


def test_min_tokens_masks_eos_and_stop_ids(engines):
    # EOS (255) forced by a bias: without min_tokens it ends at once, with it not before
    sp = SamplingParams(max_tokens=10, logit_bias={255: 100.0})
    assert _generate(engines["sync"], PROMPTS[:1], sp) == [[255]]
    out = _generate(engines["async"], PROMPTS[:1], dataclasses.replace(sp, min_tokens=4))[0]
    assert len(out) == 5 and 255 not in out[:4] and out[4] == 255
    stop = SamplingParams(max_tokens=10, logit_bias={42: 100.0}, stop_token_ids=(42,),
                          min_tokens=3)
    out = _generate(engines["sync"], PROMPTS[:1], stop)[0]
    assert len(out) == 4 and 42 not in out[:3] and out[3] == 42


def test_bad_values_name_the_field(engines):
    engine = engines["sync"]
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request([1, 2], SamplingParams(logit_bias={TINY.vocab_size: 1.0}))
    for field, value in (("presence_penalty", 3.0), ("repetition_penalty", 0.0),
                         ("logprobs", 21), ("min_tokens", -1)):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: value})
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)

