"""Speculative decoding never changes greedy output: n-gram proposals verified in one
forward pass give exactly the tokens (and logprobs) decoding one token at a time gives,
alone or batched, under rotation, prefix hits, chunked prefill and forks; the proposer
and the acceptance rule against plain-Python references; bad config named by its key.

The reference is the same tiny model on an engine without speculation (same compiled
shapes for prefill and decode: the persistent XLA cache serves both)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from scipy.stats import chisquare

from models.config import ModelConfig
from models.servable import random_servable
from serving.metrics import _SnapshotCollector
from superinfer_jax import EngineConfig, LLMEngine, SamplingParams
from superinfer_jax.config_schema import ConfigError
from superinfer_jax.kv.layout import PoolLayout
from superinfer_jax.model_api import StepInputs
from superinfer_jax.request import FieldError, RequestStatus
from superinfer_jax.spec.proposer import ngram_propose, resolve_proposer
from superinfer_jax.spec.verify import accepted_length, make_verify
from tests.superinfer_jax.engine_testlib import (
    SMALL,
    SPEC_SAMPLING,
    run_alone,
    run_batched,
    run_rotating,
)

SP = SPEC_SAMPLING  # the requests of ``spec_reference``


def _ngram_reference(tokens: list[int], k: int) -> list[int]:
    """Prompt lookup in plain Python: longest suffix (4..1) first, latest occurrence."""
    for n in range(min(4, len(tokens) - 1), 0, -1):
        suffix = tokens[-n:]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


def test_ngram_proposer_matches_a_plain_reference():
    rng = np.random.default_rng(0)
    cases = [[1, 2, 3, 4, 9, 1, 2, 3, 4], [5, 6, 7], [1, 2, 1, 3, 1], [7], [4, 4, 4, 4]]
    cases += [rng.integers(0, 6, int(n)).tolist() for n in rng.integers(1, 40, 200)]
    for tokens in cases:
        for k in (1, 3, 5):
            got = ngram_propose(np.asarray(tokens, np.int32), k).tolist()
            assert got == _ngram_reference(tokens, k), (tokens, k)
    # the longest match wins over a later shorter one
    assert ngram_propose(np.asarray([1, 2, 3, 8, 9, 3, 7, 0, 2, 3]), 2).tolist() == [8, 9]


def test_accepted_length_stops_at_the_first_rejection():
    assert accepted_length(np.array([True, True, True, False]), 3) == 3
    assert accepted_length(np.array([True, False, True, False]), 3) == 1
    assert accepted_length(np.array([False, True, True, False]), 3) == 0
    assert accepted_length(np.array([False, False]), 0) == 0


def _spec(k: int, **changes) -> EngineConfig:
    return SMALL.replace(speculative_method="ngram", num_speculative_tokens=k, **changes)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_tokens_equal_with_ngram_speculation(tiny, spec_prompts, spec_reference, k):
    engine = LLMEngine(tiny, _spec(k))
    assert run_alone(engine, spec_prompts, SP) == spec_reference
    done = run_batched(engine, spec_prompts, SP)  # batched, and the second time prefix hits
    assert [r.output_token_ids for r in done] == spec_reference
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in done)
    stats = engine.stats()
    spec = stats.spec_decode
    assert spec is not None and 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    assert stats["prefix_cache_hits"] > 0
    assert sum(spec.accepted_per_pos) == spec.num_accepted_tokens
    assert sum(r.num_spec_accepted for r in done) <= spec.num_accepted_tokens
    for r in done:  # a rejection: a verification that refused a guess (and those after it)
        assert r.num_spec_accepted + r.num_spec_rejections <= r.num_spec_proposed
        assert (r.num_spec_rejections > 0) == (r.num_spec_accepted < r.num_spec_proposed)
    assert len(spec.accepted_per_pos) == k
    # fewer model steps than tokens: accepted tokens came for free
    assert engine.num_model_steps < 2 * sum(len(t) for t in spec_reference)


def test_rotation_keeps_speculated_greedy_tokens(tiny, spec_prompts, spec_reference):
    engine = LLMEngine(tiny, _spec(3, num_device_pages=12, num_host_pages=64))
    done = run_rotating(engine, spec_prompts, SP, every=3)
    assert [r.output_token_ids for r in done] == spec_reference
    assert sum(r.num_rotations for r in done) >= 2
    assert engine.stats().spec_decode.num_accepted_tokens > 0


def test_recompute_keeps_speculated_greedy_tokens(tiny, spec_prompts, spec_reference):
    engine = LLMEngine(tiny, _spec(5, num_device_pages=10))
    done = run_rotating(engine, spec_prompts, SP, every=2)
    assert [r.output_token_ids for r in done] == spec_reference
    assert sum(r.num_preemptions for r in done) >= 1


def test_logprobs_stops_and_lengths_as_without_speculation(tiny, spec_prompts):
    plain, spec = LLMEngine(tiny, SMALL), LLMEngine(tiny, _spec(3))
    first = run_alone(plain, spec_prompts[:1], SP)[0]
    stop = first[10]  # a stop token id the output reaches
    jobs = [SamplingParams(max_tokens=24, ignore_eos=True, logprobs=3),
            SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=(stop,)),
            SamplingParams(max_tokens=7, ignore_eos=True)]
    for sp in jobs:
        want = run_batched(plain, spec_prompts[:3], sp)
        got = run_batched(spec, spec_prompts[:3], sp)
        assert [r.output_token_ids for r in got] == [r.output_token_ids for r in want]
        assert [r.status for r in got] == [r.status for r in want]
        if sp.logprobs:
            for a, b in zip(got, want, strict=True):
                assert len(a.output_logprobs) == len(b.output_logprobs) == 24
                for x, y in zip(a.output_logprobs, b.output_logprobs, strict=True):
                    assert x.token_id == y.token_id and x.rank == y.rank
                    # float32 logits of the same state, by another shape of matmul
                    assert abs(x.logprob - y.logprob) < 1e-4
                    assert [t for t, _ in x.top] == [t for t, _ in y.top]
    assert spec.stats().spec_decode.num_accepted_tokens > 0


def test_forks_and_opt_out(tiny, spec_prompts, spec_reference):
    engine = LLMEngine(tiny, _spec(3))
    first = engine.add_request(spec_prompts[0], SP, cache_salt="n2")
    fork = engine.add_request(spec_prompts[0], SP, cache_salt="n2", fork_of=first)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.release(first).output_token_ids == spec_reference[0]
    assert engine.release(fork).output_token_ids == spec_reference[0]
    before = engine.stats().spec_decode.num_drafts
    out = run_batched(engine, spec_prompts, SamplingParams(max_tokens=24, ignore_eos=True,
                                                   speculative=False))
    assert [r.output_token_ids for r in out] == spec_reference
    assert engine.stats().spec_decode.num_drafts == before  # nobody speculated


def test_metrics_use_vllm_names():
    collector = _SnapshotCollector("m")
    collector.stats = {"spec_decode_num_drafts": 4, "spec_decode_num_draft_tokens": 9,
                       "spec_decode_num_accepted_tokens": 5,
                       "spec_decode_num_accepted_tokens_pos_0": 4,
                       "spec_decode_num_accepted_tokens_pos_1": 1}
    families = {f.name: f for f in collector.collect()}
    assert families["vllm:spec_decode_num_drafts"].samples[0].value == 4
    assert families["vllm:spec_decode_num_draft_tokens"].samples[0].value == 9
    assert families["vllm:spec_decode_num_accepted_tokens"].samples[0].value == 5
    per_pos = families["vllm:spec_decode_num_accepted_tokens_per_pos"].samples
    assert [(s.labels["position"], s.value) for s in per_pos] == [("0", 4), ("1", 1)]


@pytest.mark.parametrize("knobs,key", [
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({"speculative_method": "medusa"}, "speculative_method"),
    ({"speculative_mode": "eager"}, "speculative_mode"),
])
def test_bad_config_names_the_key(knobs, key):
    """Named as the caller spelled it: the flat knob (the YAML names the section key)."""
    with pytest.raises(ConfigError) as e:
        EngineConfig.build(**knobs)
    assert e.value.key == key


def test_unloadable_proposer_and_bad_opt_out_are_named(tiny):
    with pytest.raises(ConfigError, match="speculative.draft_model"):
        LLMEngine(tiny, SMALL.replace(speculative_method="draft"))
    with pytest.raises(ConfigError, match="speculative.method"):
        resolve_proposer("no_such_module_xyz:Proposer")
    with pytest.raises(FieldError, match="speculative"):
        SamplingParams(speculative="yes")


def test_step_budget_counts_verified_tokens(tiny, spec_prompts, spec_reference):
    engine = LLMEngine(tiny, _spec(5, max_num_batched_tokens=16))
    ids = [engine.add_request(p, SP) for p in spec_prompts]
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.last_stats
        assert stats.num_prefill_tokens + stats.num_decode_tokens <= 16
    assert [engine.release(r).output_token_ids for r in ids] == spec_reference


V32 = ModelConfig(name="tiny32", vocab_size=32, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                  max_position_embeddings=64, eos_token_ids=(31,))
# low enough that the random model's flat logits give bins worth testing
TEMPERATURE = 0.06
DRAWS = 800


def _exact_joint(model, prompt: list[int]) -> np.ndarray:
    """The target's distribution of its first three sampled tokens, by enumeration: one
    plain forward over every prompt + (a, b), the logits at every position (float64
    softmax at ``TEMPERATURE``, no top-k or top-p)."""
    n = len(prompt)
    rows = np.array([prompt + [a, b] for a in range(32) for b in range(32)], np.int32)
    batch, cols = rows.shape
    per_row = -(-cols // 8)
    pool = PoolLayout(model.kv_spec, 8, "float32").zeros(1 + batch * per_row)
    tables = (1 + np.arange(batch * per_row)).reshape(batch, per_row)
    inputs = StepInputs.from_numpy(rows, np.tile(np.arange(cols), (batch, 1)),
                                   np.full(batch, cols), np.full(batch, cols), tables)
    logits = np.asarray(model.forward(model.params, pool, inputs, all_logits=True)[0],
                        np.float64) / TEMPERATURE

    def softmax(x):
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    p1, p2 = softmax(logits[0, n - 1]), softmax(logits[::32, n])
    p3 = softmax(logits[:, n + 1]).reshape(32, 32, 32)
    return (p1[:, None, None] * p2[:, :, None] * p3).ravel()


def _joint_p_value(engine, prompt: list[int], joint: np.ndarray) -> float:
    """Chi-square of the first three tokens of ``DRAWS`` seeded requests against
    ``joint``; bins expected under 5 draws are pooled into one."""
    sps = [SamplingParams(max_tokens=4, temperature=TEMPERATURE, seed=s, ignore_eos=True)
           for s in range(DRAWS)]
    counts = np.zeros(joint.shape[0])
    for r in _batched_jobs(engine, prompt, sps):
        a, b, c = r.output_token_ids[:3]
        counts[(a * 32 + b) * 32 + c] += 1
    expected = joint * DRAWS
    big = expected >= 5
    assert big.sum() >= 10
    observed = np.append(counts[big], counts[~big].sum())
    return float(chisquare(observed, np.append(expected[big], expected[~big].sum())).pvalue)


def _batched_jobs(engine, prompt, sps):
    ids = [engine.add_request(prompt, sp) for sp in sps]
    while engine.has_unfinished_requests():
        engine.step()
    return [engine.release(r) for r in ids]


def test_sampled_tokens_follow_the_target_distribution_exactly():
    """Speculative sampling's output distribution is the target's (p > 0.001), and the
    same test rejects a rule that redraws a rejected guess from the target's own
    distribution instead of the residual (p < 1e-6)."""
    model = random_servable(V32, seed=3)
    config = EngineConfig.build(max_model_len=64, max_num_seqs=32, max_num_batched_tokens=512,
                                max_prefill_chunk=32, max_prefill_rows=16, page_size=8,
                                warmup=False, show_progress=False)
    greedy = LLMEngine(model, config)
    # the prompt is the model's own greedy text: proposals the target often takes
    prompt = [1, 2, 3] + _batched_jobs(greedy, [1, 2, 3], [
        SamplingParams(max_tokens=16, ignore_eos=True)])[0].output_token_ids
    joint = _exact_joint(model, prompt)
    engine = LLMEngine(model, config.replace(speculative_method="ngram",
                                             num_speculative_tokens=3))
    assert _joint_p_value(engine, prompt, joint) > 0.001
    spec = engine.stats().spec_decode
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens  # both branches ran
    engine.spec._verify = make_verify(model, engine.runner._params_treedef,
                                      engine.runner.backend, rule="resample_target")
    assert _joint_p_value(engine, prompt, joint) < 1e-6


def test_tensor_parallel_speculation_keeps_greedy_tokens():
    """TP=2 (2 virtual CPU devices, in a subprocess) with speculation = TP=1 without."""
    cmd = [sys.executable, "-m", "tests.superinfer_jax.spec_tp_check"]
    cache = jax.config.jax_compilation_cache_dir
    if cache:
        cmd += ["--cache-dir", cache]
    proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[2], capture_output=True,
                          text=True, timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["identical"] and result["accepted"] > 0
    assert result["draft_identical"] and result["draft_accepted"] > 0  # spec_draft: TP too


def test_structured_outputs_speculate_within_the_grammar(smollm2_tokenizer):
    """Grammar rows speculate (proposals cut where the grammar rejects them, every column
    masked by the grammar's state there): the same greedy tokens, still valid."""
    from superinfer_jax.structured import StructuredOutputSpec
    from tests.superinfer_jax.engine_testlib import VOCAB_CONFIG, run_jobs, tiny_with_tokenizer

    model = tiny_with_tokenizer(smollm2_tokenizer, seed=0)
    tok = model.tokenizer
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "tags": {"type": "array", "maxItems": 6,
                                                        "items": {"type": "string"}}},
              "required": ["name", "tags"], "additionalProperties": False}
    config = VOCAB_CONFIG.replace(disable_any_whitespace=True)
    prompt = tok.encode('{"name": "ab", "tags": ["ab", "ab"]} {"name": "ab", "tags": ["ab"]}')
    jobs = [(prompt, SamplingParams(max_tokens=60, structured=StructuredOutputSpec(
                "json", json.dumps(schema)))),
            (prompt, SamplingParams(max_tokens=24, structured=StructuredOutputSpec(
                "regex", r"(ab|cd)+x(ab)+")))]
    want = run_jobs(LLMEngine(model, config), jobs)
    engine = LLMEngine(model, config.replace(speculative_method="ngram",
                                             num_speculative_tokens=3))
    got = run_jobs(engine, jobs)
    assert [r.output_token_ids for r in got] == [r.output_token_ids for r in want]
    assert [r.status for r in got] == [r.status for r in want]
    assert engine.stats().spec_decode.num_drafts > 0
    assert re.fullmatch(r"(ab|cd)+x(ab)+", got[1].output_text) or got[1].status == \
        RequestStatus.FINISHED_LENGTH


class NoisyProposer:
    """A plug-in (``module:Class``) whose guesses are mostly wrong, sometimes out of the
    vocabulary, and once in a while raise: the output must not change."""

    needs_hidden = False

    def __init__(self, config):
        self.calls = 0

    def propose(self, requests, ks):
        self.calls += 1
        if self.calls % 7 == 0:
            raise RuntimeError("proposer bug")
        if self.calls % 5 == 0:
            return [np.full(k, 10_000, np.int32) for k in ks]
        return [np.asarray(r.all_token_ids[-k:] if k else [], np.int32) for r, k in
                zip(requests, ks, strict=True)]


def test_a_plugin_proposer_never_changes_the_output(tiny, spec_prompts, spec_reference):
    engine = LLMEngine(tiny, SMALL.replace(
        speculative_method="tests.superinfer_jax.test_speculative:NoisyProposer",
        num_speculative_tokens=2))
    assert [r.output_token_ids for r in run_batched(engine, spec_prompts, SP)] == spec_reference
    assert engine.stats().spec_decode.num_drafts > 0


def test_http_opt_out_field_is_a_strict_bool():
    from pydantic import ValidationError

    from serving.openai_schema import CompletionRequest

    assert CompletionRequest(model="m", prompt="x").speculative is True
    assert CompletionRequest(model="m", prompt="x", speculative=False).speculative is False
    with pytest.raises(ValidationError, match="speculative"):
        CompletionRequest(model="m", prompt="x", speculative="maybe")
