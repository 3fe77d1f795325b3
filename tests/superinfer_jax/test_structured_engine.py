"""Structured outputs through the engine: every output parses and validates, under sync
and async scheduling and under rotation; an unconstrained request beside a constrained one
keeps async overlap and its own tokens; a bad spec names its field.

The model is a tiny random Llama over SmolLM2's real 49,152-token vocabulary and chat
template (the grammar masks are what is tested, over a real BPE vocabulary; a 30-layer
model would only make each compile slower). The engine runs with
``disable_any_whitespace``: a random model, unlike a trained one, never chooses to close
an object while JSON's free whitespace lets it pad, so every JSON output here ending with
``stop`` also shows that the option reached the grammar."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from superinfer_jax import LLMEngine, SamplingParams
from superinfer_jax.request import FieldError
from superinfer_jax.structured import StructuredOutputSpec
from tests.numerics import logits_tolerance
from tests.superinfer_jax.engine_testlib import VOCAB_CONFIG, run_jobs, tiny_with_tokenizer

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
# compile only the shapes these requests run (shared with the LLM API test)
CONFIG = VOCAB_CONFIG.replace(disable_any_whitespace=True)
# largest |logit| of the tiny model bounds its float32 error (far above what it reaches)
LOGIT_SCALE = 30.0


@pytest.fixture(scope="module")
def model(smollm2_tokenizer):
    return tiny_with_tokenizer(smollm2_tokenizer, seed=0)


@pytest.fixture(scope="module")
def engines(model):
    return {mode: LLMEngine(model, CONFIG.replace(async_scheduling=mode == "async"))
            for mode in ("sync", "async")}


def _compact(text: str) -> bool:
    """No whitespace outside JSON strings (what ``disable_any_whitespace`` promises)."""
    return not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', '""', text))


def _chat(tok, text: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}],
                                              add_generation_prompt=True))


@pytest.mark.parametrize("mode,rotate", [("sync", 0), ("async", 0), ("async", 3)])
def test_constrained_outputs_parse_and_validate(engines, model, mode, rotate):
    tok = model.tokenizer
    json_spec = StructuredOutputSpec("json", json.dumps(SCHEMA))
    jobs = [
        (_chat(tok, "Describe a person as JSON."),
         SamplingParams(max_tokens=60, structured=json_spec)),
        (_chat(tok, "Give me a JSON object about a cat."),
         SamplingParams(max_tokens=60, temperature=0.8, seed=1,
                        structured=StructuredOutputSpec("json_object"))),
        (_chat(tok, "What is 2+2? Answer with a date."),
         SamplingParams(max_tokens=20, structured=StructuredOutputSpec(
             "regex", r"\d{4}-\d{2}-\d{2}"))),
        (_chat(tok, "Is the sky blue?"),
         SamplingParams(max_tokens=10, structured=StructuredOutputSpec(
             "choice", ("yes", "no", "maybe")))),
    ]
    done = run_jobs(engines[mode], jobs, rotate_every=rotate)
    assert all(r.status.finish_reason == "stop" for r in done), [r.status for r in done]
    person = json.loads(done[0].output_text)
    jsonschema.validate(person, SCHEMA)
    assert isinstance(json.loads(done[1].output_text), dict)
    assert _compact(done[0].output_text) and _compact(done[1].output_text)
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", done[2].output_text)
    assert done[3].output_text in ("yes", "no", "maybe")
    if rotate:
        assert sum(r.num_rotations for r in done) > 0


def test_unconstrained_neighbour_keeps_its_tokens(engines, model):
    """A constrained request skips every other step under async; its neighbour's greedy
    tokens are those it gets alone."""
    tok = model.tokenizer
    free = (_chat(tok, "Tell me about Paris."), SamplingParams(max_tokens=24,
                                                                ignore_eos=True))
    alone = run_jobs(engines["async"], [free])[0].output_token_ids
    spec = StructuredOutputSpec("json", json.dumps(SCHEMA))
    both = run_jobs(engines["async"], [free, (_chat(tok, "A person as JSON."),
                                          SamplingParams(max_tokens=60, structured=spec))])
    assert both[0].output_token_ids == alone
    jsonschema.validate(json.loads(both[1].output_text), SCHEMA)


def test_bad_spec_names_the_field(engines):
    for kind, value in (("regex", "(unclosed"), ("json", '{"type": "nonsense"}')):
        with pytest.raises(FieldError) as err:
            engines["sync"].add_request([1, 2, 3], SamplingParams(
                structured=StructuredOutputSpec(kind, value)))
        assert err.value.field == f"structured_outputs.{kind}"
    assert not engines["sync"].has_unfinished_requests()


def test_deferred_sampling_gives_the_sync_tokens_every_step(engines, model):
    """Under async scheduling a constrained row is sampled by the deferred call: the same
    tokens as the synchronous loop (same key, same mask), and one token per step, not one
    every other step."""
    tok = model.tokenizer
    spec = StructuredOutputSpec("json", json.dumps(SCHEMA))
    jobs = [(_chat(tok, f"Person {i} as JSON."),
             SamplingParams(max_tokens=40, temperature=0.9, seed=i, structured=spec,
                            logprobs=2)) for i in range(3)]
    sync = run_jobs(engines["sync"], jobs)
    engine = engines["async"]
    steps0 = engine.num_model_steps
    done = run_jobs(engine, jobs)
    assert [r.output_token_ids for r in done] == [r.output_token_ids for r in sync]
    assert [[lp.token_id for lp in r.output_logprobs] for r in done] == \
        [r.output_token_ids for r in done]
    # batched otherwise, so summed in another order: the model-sized float32 bound,
    # twice for a log-softmax
    tol = 2 * logits_tolerance(model.config, LOGIT_SCALE, CONFIG.model.max_model_len)
    for a, b in zip(done, sync, strict=True):
        for x, y in zip(a.output_logprobs, b.output_logprobs, strict=True):
            assert abs(x.logprob - y.logprob) <= tol
    longest = max(len(r.output_token_ids) for r in done)
    prompt_chunks = sum(-(-len(p) // CONFIG.engine.max_prefill_chunk) for p, _ in jobs)
    assert engine.num_model_steps - steps0 <= longest + prompt_chunks + 2
