"""Request bounds that need the model, and the blast radius of one bad request.

The engine checks (or fits) what only it can know, the vocabulary, in ``add_request``,
so the Python API is covered like the servers; and a request whose host-side step work
fails anyway ends alone, with an error, while every other request finishes unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest

from models.servable import random_servable
from superinfer_jax import LLMEngine, SamplingParams
from superinfer_jax.request import FieldError, RequestStatus
from superinfer_jax.runner.sampling import SEED32_MAX, sampler_seed
from tests.superinfer_jax.engine_testlib import SMALL, TINY


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(random_servable(TINY, seed=3), SMALL)


def run(engine: LLMEngine) -> dict[str, list]:
    """Step until idle; every output by request id, released as they finish."""
    outs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.req_id, []).append(out)
    for req_id in outs:
        engine.release(req_id)
    return outs


def tokens(outs: list) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def test_top_k_above_vocab_is_clamped_and_samples_like_no_cut(engine):
    prompt = [5, 6, 7]
    sp = SamplingParams(max_tokens=6, temperature=0.8, seed=11, ignore_eos=True)
    a = engine.add_request(prompt, sp)
    b = engine.add_request(prompt, SamplingParams(max_tokens=6, temperature=0.8, seed=11,
                                                  ignore_eos=True, top_k=2**31 - 1))
    c = engine.add_request(prompt, SamplingParams(max_tokens=6, temperature=0.8, seed=11,
                                                  ignore_eos=True, top_k=-1))
    assert engine.requests[b].sampling.top_k == TINY.vocab_size
    assert engine.requests[c].sampling.top_k == 0
    outs = run(engine)
    assert tokens(outs[a]) == tokens(outs[b]) == tokens(outs[c])


def test_large_seeds_fold_into_32_bits_deterministically(engine):
    assert sampler_seed(7) == 7 and sampler_seed(SEED32_MAX) == SEED32_MAX
    folded = {sampler_seed(s) for s in (2**32, 2**32 + 1, 2**63, 2**64 - 1)}
    assert len(folded) == 4 and all(0 <= s <= SEED32_MAX for s in folded)
    sp = SamplingParams(max_tokens=8, temperature=1.0, seed=2**64 - 1, ignore_eos=True)
    first = engine.add_request([9, 9, 9], sp)
    second = engine.add_request([9, 9, 9], sp)
    assert engine.requests[first].sampling.seed == sampler_seed(2**64 - 1)
    outs = run(engine)
    assert tokens(outs[first]) == tokens(outs[second])  # reproducible


def test_vocabulary_bounds_checked_at_intake(engine):
    vocab = TINY.vocab_size
    with pytest.raises(FieldError, match=rf"stop_token_ids must be in \[0, {vocab}\)") as e:
        engine.add_request([1, 2], SamplingParams(stop_token_ids=(vocab,)))
    assert e.value.field == "stop_token_ids"
    for bad in ([1, vocab], [-1], [2**40], [True, 2], [1.0]):
        with pytest.raises(FieldError, match="prompt token ids") as e:
            engine.add_request(bad)
        assert e.value.field == "prompt"
    assert not engine.has_unfinished_requests()


def test_one_failing_request_ends_alone_with_an_error(engine, monkeypatch):
    """A row whose inputs cannot be built (here: a top_k that bypassed validation and
    overflows int32) fails that request; the others finish with their usual tokens."""
    prompts = [[3, 4, 5, 6], [7, 8], [10, 11, 12]]
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    ids = [engine.add_request(p, sp) for p in prompts]
    reference = run(engine)

    ids = [engine.add_request(p, SamplingParams(max_tokens=5, ignore_eos=True))
           for p in prompts]
    bad = engine.requests[ids[1]]
    object.__setattr__(bad.sampling, "top_k", 2**40)  # what validation would have refused
    outs = run(engine)
    assert [o.error for o in outs[ids[1]]][-1] is not None
    assert "out of bounds for int32" in outs[ids[1]][-1].error
    assert bad.status == RequestStatus.FINISHED_ABORTED and outs[ids[1]][-1].finished
    for i in (0, 2):
        assert tokens(outs[ids[i]]) == tokens(reference[list(reference)[i]])
        assert all(o.error is None for o in outs[ids[i]])
    assert engine.kv.num_free_pages == engine.kv.allocator.num_usable  # nothing leaked


def test_failing_detokenizer_ends_its_request_alone(engine):
    class Boom:
        def push(self, token: int) -> str:
            raise TypeError("TextInputSequence must be str")

        def flush(self) -> str:
            return ""

    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    good = engine.add_request([1, 2, 3], sp)
    bad = engine.add_request([4, 5, 6], sp)
    engine.output._detok[bad] = Boom()
    outs = run(engine)
    assert "TextInputSequence" in outs[bad][-1].error
    assert len(tokens(outs[good])) == 4 and outs[good][-1].error is None
    assert np.all([not o.error for o in outs[good]])


def test_row_without_its_pages_fails_alone_instead_of_reading_the_null_page(engine):
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    good = engine.add_request([1, 2, 3], sp)
    bad = engine.add_request([4, 5, 6], SamplingParams(max_tokens=3, ignore_eos=True))
    real = engine.kv.page_table
    engine.kv.page_table = lambda req_id: [] if req_id == bad else real(req_id)
    try:
        outs = run(engine)
    finally:
        engine.kv.page_table = real
    assert "holds 0 pages" in outs[bad][-1].error
    assert len(tokens(outs[good])) == 3 and outs[good][-1].error is None
