"""Logprobs from the jitted step against transformers on the same weights.

The model is the tiny random Llama of the engine tests (2 layers, 256 tokens), exported to
transformers: what is checked is the step's log-softmax, top-k and rank against an
independent implementation, which a 30-layer model would only make slower to compile.
SmolLM2's logprobs are checked end to end against transformers by the lm-eval test (every
loglikelihood within 1e-3).

Token logprobs of the sampled tokens and prompt logprobs at every position are the
log-softmax of transformers' float32 logits, within the model-sized float32 bound of
``tests/numerics`` (a logprob is a logit minus a log-sum-exp, each within the logits'
bound, so twice it); the top-k lists are transformers' top-k wherever its gaps exceed
that bound; chunked prefill and async scheduling give the same prompt logprobs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.hf_export import to_transformers
from superinfer_jax import LLMEngine, SamplingParams
from tests.numerics import logits_tolerance
from tests.superinfer_jax.engine_testlib import SMALL, TINY

# longer than two prefill chunks, so prompt logprobs come from several steps
PROMPT = [int(t) for t in np.random.default_rng(7).integers(1, TINY.vocab_size - 1, 37)]
CONFIG = SMALL  # compile only the shapes these requests run (shared with the engine tests)


@pytest.fixture(scope="module")
def reference(tiny):
    """(prompt ids, greedy output ids, transformers' log-softmax over prompt + output)."""
    hf = to_transformers(tiny)
    prompt = PROMPT
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)
        ids = out[0].tolist()
        logits = hf(torch.tensor([ids])).logits[0].double()
    return prompt, ids[len(prompt):], torch.log_softmax(logits, -1).numpy(), logits.numpy()


@pytest.fixture(scope="module")
def engines(tiny):
    return {mode: LLMEngine(tiny, CONFIG.replace(async_scheduling=mode == "async"))
            for mode in ("sync", "async")}


def _run(engine: LLMEngine, prompt: list[int], sampling: SamplingParams):
    rid = engine.add_request(prompt, sampling)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.req_id == rid]
    req = engine.release(rid)
    assert req is not None
    return req, outputs


def _close_top(top, ref_row: np.ndarray, tol: float, k: int) -> None:
    """``top`` (ids, logprobs) is the reference's top ``k``: each logprob within ``tol``,
    and the ids equal wherever the reference's neighbours are more than ``2 tol`` apart."""
    order = np.argsort(-ref_row)[:k + 1]
    assert len(top) == k
    for i, (tid, lp) in enumerate(top):
        assert abs(lp - ref_row[tid]) <= tol
        if ref_row[order[i]] - ref_row[order[i + 1]] > 2 * tol and (
                i == 0 or ref_row[order[i - 1]] - ref_row[order[i]] > 2 * tol):
            assert tid == order[i], f"top-{k} position {i}"


def _rank_ok(rank: int, row: np.ndarray, token: int, tol: float) -> None:
    """1 + the tokens above ``token``, counting those within ``tol`` of it either way."""
    x = row[token]
    assert 1 + np.sum(row > x + tol) <= rank <= 1 + np.sum(row > x - tol)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_token_and_prompt_logprobs_match_transformers(tiny, reference, engines, mode):
    prompt, want_tokens, ref_lp, ref_logits = reference
    tol = 2 * logits_tolerance(tiny.config, ref_logits, len(prompt) + 6)
    req, outputs = _run(engines[mode], prompt, SamplingParams(
        max_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=3))
    assert req.output_token_ids == want_tokens
    # the sampled tokens' logprobs, one per output, handed out with each token
    streamed = [lp for o in outputs for lp in (o.logprobs or [])]
    assert streamed == req.output_logprobs and len(streamed) == 6
    for i, lp in enumerate(req.output_logprobs):
        row = ref_lp[len(prompt) - 1 + i]
        assert lp.token_id == want_tokens[i]
        assert abs(lp.logprob - row[lp.token_id]) <= tol
        assert lp.rank == 1  # greedy
        _close_top(lp.top, row, tol, 5)
    # every prompt position but the first, in one list on the first output
    assert outputs[0].prompt_logprobs == req.prompt_logprobs
    assert all(o.prompt_logprobs is None for o in outputs[1:])
    assert req.prompt_logprobs[0] is None and len(req.prompt_logprobs) == len(prompt)
    assert len(prompt) > CONFIG.engine.max_prefill_chunk  # several chunks, each contributes
    for pos in range(1, len(prompt)):
        lp = req.prompt_logprobs[pos]
        row = ref_lp[pos - 1]
        assert lp is not None and lp.token_id == prompt[pos]
        assert abs(lp.logprob - row[prompt[pos]]) <= tol
        _rank_ok(lp.rank, row, prompt[pos], tol)
        _close_top(lp.top, row, tol, 3)


def test_logprobs_zero_gives_only_the_sampled_token(engines, reference):
    prompt = reference[0]
    req, _ = _run(engines["sync"], prompt, SamplingParams(max_tokens=2, logprobs=0))
    assert [lp.top for lp in req.output_logprobs] == [(), ()]
    assert all(lp.logprob <= 0 for lp in req.output_logprobs)


def test_no_logprobs_unless_asked(engines, reference):
    req, outputs = _run(engines["async"], reference[0], SamplingParams(max_tokens=3))
    assert req.output_logprobs == [] and req.prompt_logprobs == []
    assert all(o.logprobs is None and o.prompt_logprobs is None for o in outputs)


def test_sampled_logprobs_are_of_the_raw_distribution(engines, reference):
    """Temperature changes what is drawn, not the reported logprob (vLLM's default)."""
    prompt, _, ref_lp, ref_logits = reference
    req, _ = _run(engines["sync"], prompt, SamplingParams(
        max_tokens=1, temperature=5.0, seed=3, logprobs=1))
    lp = req.output_logprobs[0]
    row = ref_lp[len(prompt) - 1]
    tol = 2 * logits_tolerance(engines["sync"].model.config, ref_logits, len(prompt))
    assert abs(lp.logprob - row[lp.token_id]) <= tol
    _rank_ok(lp.rank, row, lp.token_id, tol)
