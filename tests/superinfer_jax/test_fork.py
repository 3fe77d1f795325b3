"""``n > 1`` in the engine: siblings (``fork_of``) wait for the first choice's prompt and
take its full pages from the prefix cache, so the prompt is prefilled once; each sample is
still exactly what a lone request with its seed gives."""

from __future__ import annotations

import numpy as np
import pytest

from models.servable import random_servable
from superinfer_jax import LLMEngine, SamplingParams
from tests.superinfer_jax.engine_testlib import SMALL, TINY, drain_prefilled

PROMPT = np.random.default_rng(3).integers(0, 250, 45).tolist()  # 5 full pages of 8, + 5


@pytest.fixture(scope="module")
def engine():
    # SMALL's own device pool (33 pages: the 4 + 4 requests of 7 pages run in turn, the
    # cached pages of earlier ones evictable), so the step shapes are those of the other
    # SMALL engines and the persistent XLA cache serves them
    return LLMEngine(random_servable(TINY, seed=1), SMALL.replace(async_scheduling=True))


def _sample(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=6, temperature=1.0, seed=seed, ignore_eos=True)


def test_forks_prefill_the_prompt_once_and_sample_as_alone(engine):
    alone = []
    for seed in range(4):
        rid = engine.add_request(PROMPT, _sample(seed), cache_salt=f"alone-{seed}")
        drain_prefilled(engine)
        alone.append(engine.release(rid).output_token_ids)
    assert len({tuple(a) for a in alone}) > 1  # the seeds give different samples

    first = engine.add_request(PROMPT, _sample(0), cache_salt="n4")
    rest = [engine.add_request(PROMPT, _sample(seed), cache_salt="n4", fork_of=first)
            for seed in (1, 2, 3)]
    prefilled = drain_prefilled(engine)
    reqs = [engine.release(r) for r in [first, *rest]]
    assert [r.output_token_ids for r in reqs] == alone
    full = len(PROMPT) // 8 * 8
    assert [r.num_cached_tokens for r in reqs] == [0, full, full, full]
    # the prompt once, then each sibling only its tail past the last full page
    assert prefilled == len(PROMPT) + 3 * (len(PROMPT) - full)


def test_fork_of_must_name_a_request_with_the_same_prompt(engine):
    with pytest.raises(ValueError, match="fork_of"):
        engine.add_request(PROMPT, _sample(0), fork_of="nobody")
    first = engine.add_request(PROMPT, _sample(0))
    with pytest.raises(ValueError, match="fork_of"):
        engine.add_request(PROMPT[:-1], _sample(1), fork_of=first)
    drain_prefilled(engine)
    engine.release(first)
