"""Fixtures of the engine tests (``tiny``, the suite's tiny random model, is in
``tests/conftest.py``; configs and drivers in ``engine_testlib``, scheduler fakes in
``sched_kit``)."""

from __future__ import annotations

import pytest

from models.servable import random_servable
from superinfer_jax import LLMEngine, SamplingParams
from tests.superinfer_jax.engine_testlib import (
    SMALL,
    TINY,
    CharTokenizer,
    repeating_prompts,
    run_alone,
)

SPEC_SAMPLING = SamplingParams(max_tokens=24, ignore_eos=True)
"""The speculation tests' requests: greedy, 24 tokens each."""


@pytest.fixture(scope="module")
def tiny_chars():
    """``tiny``'s weights over ``CharTokenizer`` (one token a letter), for stop strings."""
    return random_servable(TINY, seed=1, tokenizer=CharTokenizer())


@pytest.fixture(scope="module")
def spec_prompts():
    """The speculation tests' prompts (``engine_testlib.repeating_prompts``)."""
    return repeating_prompts()


@pytest.fixture(scope="module")
def spec_reference(tiny, spec_prompts):
    """``tiny``'s greedy tokens for ``spec_prompts`` without speculation, each alone."""
    return run_alone(LLMEngine(tiny, SMALL), spec_prompts, SPEC_SAMPLING)
