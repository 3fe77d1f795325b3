"""Fixtures of the engine tests (``tiny``, the suite's tiny random model, is in
``tests/conftest.py``; configs and drivers in ``engine_testlib``, scheduler fakes in
``sched_kit``)."""

from __future__ import annotations

import pytest

from models.servable import random_servable
from tests.superinfer_jax.engine_testlib import TINY, CharTokenizer


@pytest.fixture(scope="module")
def tiny_chars():
    """``tiny``'s weights over ``CharTokenizer`` (one token a letter), for stop strings."""
    return random_servable(TINY, seed=1, tokenizer=CharTokenizer())
