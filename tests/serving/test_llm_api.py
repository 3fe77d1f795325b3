"""The offline Python API (``superinfer_jax.LLM``) on the features of issue 17: ``n``
samples per prompt, prompt-major and seeded ``seed + j``, with logprobs on the outputs.

The model is the tiny random Llama over SmolLM2's tokenizer of the structured-output
engine tests, with their engine config: the same step programs, compiled once per suite
through the persistent XLA cache (decode 1/2/4 rows, prefill 1 row)."""

from __future__ import annotations

import pytest

from superinfer_jax import LLM, SamplingParams
from tests.superinfer_jax.engine_testlib import VOCAB_CONFIG, tiny_with_tokenizer


@pytest.fixture(scope="module")
def llm(smollm2_tokenizer):
    return LLM(tiny_with_tokenizer(smollm2_tokenizer), VOCAB_CONFIG)


def test_n_samples_per_prompt_with_logprobs(llm):
    sampling = SamplingParams(max_tokens=3, temperature=1.0, seed=5, ignore_eos=True,
                              logprobs=2, prompt_logprobs=1)
    outs = llm.generate(["Hello there", "Once"], sampling, n=3)
    assert [o.index for o in outs] == [0, 1, 2, 0, 1, 2]
    assert len({tuple(o.token_ids) for o in outs[:3]}) > 1  # the samples differ
    for o in outs:
        assert len(o.logprobs) == len(o.token_ids) == 3
        assert [e.token_id for e in o.logprobs] == o.token_ids
        assert all(e.logprob <= 0 and len(e.top) == 2 for e in o.logprobs)
        assert len(o.prompt_logprobs) == len(o.prompt_token_ids)
        assert o.prompt_logprobs[0] is None
        assert all(e.token_id == t for e, t in zip(o.prompt_logprobs[1:],
                                                   o.prompt_token_ids[1:], strict=True))
    # sample j is the prompt alone with seed 5 + j
    (alone,) = llm.generate("Hello there", SamplingParams(
        max_tokens=3, temperature=1.0, seed=6, ignore_eos=True))
    assert alone.token_ids == outs[1].token_ids and alone.logprobs is None
    with pytest.raises(ValueError, match="n must be"):
        llm.generate("Hi", sampling, n=0)
