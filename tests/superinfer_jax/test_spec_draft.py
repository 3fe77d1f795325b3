"""The draft-model proposer never changes greedy output: a draft identical to the target
accepts every guess, a different draft (the target cut to its first layer) still gives
the target's tokens, batched, under rotation and under preemption; its page bookkeeping
against hand-worked cases; a draft with another vocabulary, none at all, and bad
``draft_layers`` are errors naming their key.

The reference is the tiny model on an engine without speculation (the same prefill and
decode shapes: the persistent XLA cache serves both)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

from models.draft import first_layers, load_draft
from models.servable import random_servable
from superinfer_jax import EngineConfig, LLMEngine, SamplingParams
from superinfer_jax.config_schema import ConfigError
from superinfer_jax.request import Request, RequestStatus
from superinfer_jax.spec.draft import TAIL
from superinfer_jax.spec.draft_kv import DraftPages
from tests.superinfer_jax.engine_testlib import (
    SMALL,
    SPEC_SAMPLING,
    TINY,
    run_batched,
    run_rotating,
)

SP = SPEC_SAMPLING  # the requests of ``spec_reference``


def _draft(k: int, **changes) -> EngineConfig:
    return SMALL.replace(speculative_method="draft", speculative_draft_model="tiny",
                         num_speculative_tokens=k, **changes)


@pytest.fixture(scope="module")
def shallow(tiny):
    """A draft that sometimes agrees with the target: its first of two layers."""
    return first_layers(tiny, 1)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_a_draft_equal_to_the_target_accepts_every_guess(tiny, spec_prompts, spec_reference, k):
    engine = LLMEngine(tiny, _draft(k), draft_model=tiny)
    done = run_batched(engine, spec_prompts, SP)
    assert [r.output_token_ids for r in done] == spec_reference
    spec = engine.stats().spec_decode
    assert spec.num_draft_tokens > 0
    assert spec.num_accepted_tokens == spec.num_draft_tokens  # acceptance 1.0
    # k + 1 tokens a verify step: far fewer model steps than tokens
    assert engine.num_model_steps < sum(len(t) for t in spec_reference) * 2 / (k + 1) + 20


class CountingDraft:
    """A draft model that records the (rows, columns) of each step it runs on the device
    (a ``jax.debug.callback`` per forward, so a loop's steps each count)."""

    def __init__(self, model):
        self.model = model
        self.shapes: list[tuple[int, int]] = []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, params, pool, inputs, **kw):
        jax.debug.callback(functools.partial(self.shapes.append, inputs.tokens.shape))
        return self.model.forward(params, pool, inputs, **kw)


def test_a_proposal_is_k_draft_steps_catch_up_included(tiny, spec_prompts, spec_reference):
    """Every guess accepted leaves the draft 2 tokens behind (the last guess and the
    target's bonus token): it catches up on both in one step of 2 one-column decode rows
    per row, whose greedy token is the first guess, then runs k - 1 one-column steps of
    the proposal's rows: k steps a proposal, not k + 1."""
    k = 3
    draft = CountingDraft(tiny)
    engine = LLMEngine(tiny, _draft(k), draft_model=draft)
    assert [r.output_token_ids for r in run_batched(engine, spec_prompts, SP)] == spec_reference
    chunk = SMALL.engine.max_prefill_chunk
    steps = [shape for shape in draft.shapes if shape != (1, chunk)]  # no chunks
    assert {cols for _, cols in steps} == {1}
    assert steps and len(steps) % k == 0
    for first in range(0, len(steps), k):  # one proposal: catch-up, then k - 1 steps
        rows = steps[first + 1][0]
        assert steps[first][0] == TAIL * rows
        assert steps[first + 1:first + k] == [(rows, 1)] * (k - 1)
    spec = engine.stats().spec_decode
    assert spec.num_accepted_tokens == spec.num_draft_tokens  # caught up right every time


def test_a_different_draft_keeps_greedy_tokens_batched(tiny, shallow, spec_prompts, spec_reference):
    engine = LLMEngine(tiny, _draft(3), draft_model=shallow)
    assert [r.output_token_ids for r in run_batched(engine, spec_prompts, SP)] == spec_reference
    spec = engine.stats().spec_decode
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens


def test_rotation_keeps_greedy_tokens_with_a_draft(tiny, shallow, spec_prompts, spec_reference):
    """With the draft's bookkeeping cut to 12 of its pool's pages, rotated-out requests
    lose their draft pages to running ones (re-prefilled when they return) and some
    proposals find no pages (those rows decode as usual)."""
    engine = LLMEngine(tiny, _draft(3, num_device_pages=12, num_host_pages=64),
                       draft_model=shallow)
    proposer = engine.spec.proposer
    proposer.pages = DraftPages(13, proposer.pages.page_size)
    done = run_rotating(engine, spec_prompts, SP, every=3)
    assert [r.output_token_ids for r in done] == spec_reference
    assert sum(r.num_rotations for r in done) >= 2
    assert engine.stats().spec_decode.num_accepted_tokens > 0
    assert proposer.pages.num_evicted > 0
    # finished requests' draft pages are freed at the next proposal: the last one's remain
    assert len(engine.spec.proposer.pages.entries) <= 1


def test_preemption_keeps_greedy_tokens_with_a_draft(tiny, shallow, spec_prompts, spec_reference):
    engine = LLMEngine(tiny, _draft(5, num_device_pages=10), draft_model=shallow)
    done = run_rotating(engine, spec_prompts, SP, every=2)
    assert [r.output_token_ids for r in done] == spec_reference
    assert sum(r.num_preemptions for r in done) >= 1


def _req(req_id: str, tokens: list[int]) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=8))


def test_draft_pages_keep_the_guesses_that_came_true_and_evict_lru():
    pages = DraftPages(num_pages=7, page_size=4)  # 6 usable pages
    a, b = _req("a", list(range(10))), _req("b", list(range(5)))
    assert pages.sync(a, np.arange(10)) == 0  # new: everything to prefill
    assert pages.reserve("a", 12, {"a"})
    assert len(pages.page_table("a")) == 3
    pages.written("a", 10, np.array([50, 51]))  # guesses' KV at positions 10 and 11
    # the next tokens are the first guess, then another: one guess came true
    assert pages.sync(a, np.array([*range(10), 50, 60, 70])) == 11
    pages.written("a", 13, np.zeros(0))
    assert pages.sync(a, np.arange(13)) == 12  # never past the last token
    assert pages.sync(b, np.arange(5)) == 0
    assert pages.reserve("b", 8, {"b"})  # a keeps its 3 pages, b takes 2
    assert not pages.reserve("b", 40, {"a", "b"})  # more than the pool, a kept
    assert pages.reserve("b", 16, {"b"})  # a, least recently used, is evicted
    assert "a" not in pages.entries and pages.num_evicted == 1
    b.set_status(RequestStatus.FINISHED_LENGTH)
    pages.drop_finished()
    assert not pages.entries and pages.allocator.num_free == 6


def test_a_draft_with_another_vocabulary_is_refused(tiny):
    other = random_servable(dataclasses.replace(TINY, vocab_size=128), seed=0)
    with pytest.raises(ConfigError, match="speculative.draft_model") as e:
        LLMEngine(tiny, _draft(3), draft_model=other)
    assert "128" in str(e.value) and "256" in str(e.value)
    with pytest.raises(ConfigError, match="speculative.draft_model"):
        LLMEngine(tiny, _draft(3))  # method draft without a draft model
    with pytest.raises(ConfigError) as e:
        EngineConfig.build(speculative_method="draft", speculative_draft_model="tiny",
                           num_speculative_tokens=17)
    assert e.value.key == "num_speculative_tokens"


def test_bad_draft_layers_and_source_are_named(tiny):
    with pytest.raises(ConfigError, match="speculative.draft_layers"):
        first_layers(tiny, 3)
    with pytest.raises(ConfigError) as e:
        EngineConfig.build(speculative_draft_layers=0)
    assert e.value.key == "speculative_draft_layers"
    spec = EngineConfig.build(speculative_method="draft",
                              speculative_draft_model="/no/such/model").speculative
    with pytest.raises(ConfigError, match="speculative.draft_model"):
        load_draft(spec, "float32")
    assert load_draft(EngineConfig().speculative, "float32") is None


def test_the_server_loads_the_draft_only_for_method_draft():
    from serving.deploy_config import DeploymentConfig
    from serving.server import load_draft_of

    assert load_draft_of(DeploymentConfig.load(None, {"speculative.method": "ngram"})) is None
    config = DeploymentConfig.load(None, {"speculative.method": "draft",
                                          "speculative.draft_model": "/no/such/model",
                                          "speculative.draft_quantization": "int8"})
    with pytest.raises(ConfigError, match="speculative.draft_model"):
        load_draft_of(config)
