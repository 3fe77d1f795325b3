"""The API real clients need (issue 17), through both fronts of the shared server: logprobs
(chat, legacy completions with echo, gRPC), ``n`` and several prompts per request,
penalties, ``logit_bias``, ``min_tokens``, structured outputs, and the tokenizer routes;
with the official ``openai`` client where it has a say.

The model is random, so these tests check shapes and wiring, not quality: every sampled
token appears with its logprob, top lists are sorted, logprobs are <= 0, a greedy token is
the top-1, n choices are indexed and reproducible by seed. Logprob values against
transformers are the engine's tests."""

from __future__ import annotations

import json
import math
import re

import grpc
import httpx
import openai
import pytest

from tests.serving.serving_testlib import API_KEY, AUTH, pb2, wait_idle

MODEL = "tiny-llama"
BEARER = {"Authorization": f"Bearer {API_KEY}"}
MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.http_url, headers=BEARER, timeout=60) as c:
        yield c


def _post(http: httpx.Client, path: str, body: dict) -> dict:
    r = http.post(path, json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _sse(http: httpx.Client, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _check_chat_entry(entry, k: int, greedy: bool) -> None:
    """One ``logprobs.content`` item (a dict or the client's object)."""
    get = entry.get if isinstance(entry, dict) else lambda name: getattr(entry, name)
    top = get("top_logprobs")
    assert len(top) == k
    assert get("logprob") <= 0
    values = [t["logprob"] if isinstance(t, dict) else t.logprob for t in top]
    assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
    token = get("token")
    if "\ufffd" not in token:
        assert bytes(get("bytes")).decode("utf-8") == token
    if greedy and k:
        first = top[0] if isinstance(top[0], dict) else top[0].model_dump()
        assert first["token"] == token and math.isclose(first["logprob"], get("logprob"),
                                                        abs_tol=1e-5)


# -- chat logprobs ------------------------------------------------------------------------


def test_chat_logprobs_with_the_openai_client(client):
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=3, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 6
    for entry in content:
        _check_chat_entry(entry, 3, greedy=True)
    # logprobs without top_logprobs: the token's own logprob, no alternatives
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, logprobs=True,
        extra_body={"ignore_eos": True})
    assert [len(e.top_logprobs) for e in out.choices[0].logprobs.content] == [0, 0, 0]
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert out.choices[0].logprobs is None


def test_chat_logprobs_streamed_match_the_tokens(http):
    chunks = _sse(http, "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 5, "temperature": 0, "logprobs": True,
        "top_logprobs": 2, "ignore_eos": True, "stream_options": {"include_usage": True}})
    entries = [e for c in chunks for ch in c["choices"] if ch["logprobs"]
               for e in ch["logprobs"]["content"]]
    assert len(entries) == chunks[-1]["usage"]["completion_tokens"] == 5
    for entry in entries:
        _check_chat_entry(entry, 2, greedy=True)
    streamed = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
    whole = _post(http, "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 5, "temperature": 0, "logprobs": True,
        "top_logprobs": 2, "ignore_eos": True})["choices"][0]
    assert streamed == whole["message"]["content"]
    assert [e["token"] for e in entries] == [e["token"] for e in whole["logprobs"]["content"]]


# -- n ------------------------------------------------------------------------------------


def test_chat_n_with_the_openai_client_is_reproducible_by_seed(client):
    def sample(n: int, seed: int) -> list[str]:
        out = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=6, temperature=1.0, n=n, seed=seed,
            extra_body={"ignore_eos": True})
        assert [c.index for c in out.choices] == list(range(n))
        assert out.usage.completion_tokens == 6 * n
        return [c.message.content for c in out.choices]

    texts = sample(3, 7)
    assert len(set(texts)) > 1  # the n samples differ
    assert sample(3, 7) == texts  # and are reproducible
    assert sample(1, 8) == texts[1:2]  # choice j is seeded seed + j


def test_completions_n_over_several_prompts(http):
    prompts = ["The sky is", "Once upon a time"]
    out = _post(http, "/v1/completions", {"prompt": prompts, "n": 2, "max_tokens": 3,
                                          "temperature": 0.8, "seed": 1, "ignore_eos": True})
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]  # prompt * n + j
    lens = [_post(http, "/tokenize", {"prompt": p})["count"] for p in prompts]
    assert out["usage"]["prompt_tokens"] == sum(lens)  # each prompt once
    assert out["usage"]["completion_tokens"] == 4 * 3
    # choice 2 (the second prompt's first) is that prompt alone with the same seed
    alone = _post(http, "/v1/completions", {"prompt": prompts[1], "max_tokens": 3,
                                            "temperature": 0.8, "seed": 1, "ignore_eos": True})
    assert out["choices"][2]["text"] == alone["choices"][0]["text"]
    # token-id prompts, several of them
    ids = _post(http, "/tokenize", {"prompt": prompts[0]})["tokens"]
    out = _post(http, "/v1/completions", {"prompt": [ids, ids[:1]], "max_tokens": 2,
                                          "ignore_eos": True})
    assert len(out["choices"]) == 2 and out["usage"]["prompt_tokens"] == len(ids) + 1


def test_streamed_choices_interleave_by_index(http):
    chunks = _sse(http, "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 4, "n": 3, "temperature": 1.0,
        "ignore_eos": True, "stream_options": {"include_usage": True}})
    by_index: dict[int, list[dict]] = {}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        by_index.setdefault(choice["index"], []).append(choice)
    assert sorted(by_index) == [0, 1, 2]
    for choices in by_index.values():
        assert choices[0]["delta"]["role"] == "assistant"
        assert [c["finish_reason"] for c in choices].count("length") == 1
        assert choices[-1]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12


def test_abandoning_a_stream_aborts_every_choice(http, stub):
    with http.stream("POST", "/v1/completions", json={
            "model": MODEL, "prompt": "Count:", "n": 4, "max_tokens": 200,
            "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                break
    wait_idle(stub)  # every choice aborted, every page free


# -- legacy completions logprobs (what evaluation harnesses parse) ------------------------


def test_echo_logprobs_as_lm_eval_local_completions_sends_them(http):
    """lm-eval's ``local-completions`` loglikelihood: token-id prompts, echo, logprobs 1,
    max_tokens 1, temperature 0; it sums ``token_logprobs[ctxlen:-1]`` and calls a
    continuation greedy when each of its logprobs is the max of ``top_logprobs``."""
    context = _post(http, "/tokenize", {"prompt": "Question: the colour of the sky?"})["tokens"]
    cont = _post(http, "/tokenize", {"prompt": " Answer: blue"})["tokens"]
    prompts = [context + cont, context[:4] + cont]
    out = _post(http, "/v1/completions", {"prompt": prompts, "echo": True, "logprobs": 1,
                                          "max_tokens": 1, "temperature": 0, "seed": 1234})
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for choice, prompt in zip(out["choices"], prompts, strict=True):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) \
            == len(lp["text_offset"]) == len(prompt) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for token, value, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:],
                                     lp["top_logprobs"][1:], strict=True):
            assert value <= 0 and token in top and top[token] == value
            assert 1 <= len(top) <= 2 and max(top.values()) >= value
        assert lp["text_offset"] == sorted(lp["text_offset"])
        # the sampled (greedy) token is the top-1
        assert lp["token_logprobs"][-1] == max(lp["top_logprobs"][-1].values())
        assert choice["text"].startswith(_post(http, "/detokenize", {"tokens": prompt})["prompt"])
        ctxlen = len(prompt) - len(cont)
        score = sum(lp["token_logprobs"][ctxlen:-1])
        assert math.isfinite(score) and score < 0
    # the same prompt scored alone gives the same prompt logprobs
    alone = _post(http, "/v1/completions", {"prompt": prompts[0], "echo": True, "logprobs": 1,
                                            "max_tokens": 1, "temperature": 0})
    first = out["choices"][0]["logprobs"]["token_logprobs"]
    again = alone["choices"][0]["logprobs"]["token_logprobs"]
    assert first[0] is None and again[0] is None
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(first[1:], again[1:],
                                                               strict=True))


def test_echo_with_max_tokens_zero_scores_the_prompt_only(http):
    ids = _post(http, "/tokenize", {"prompt": "Score this prompt"})["tokens"]
    out = _post(http, "/v1/completions", {"prompt": "Score this prompt", "echo": True,
                                          "logprobs": 0, "max_tokens": 0})
    choice = out["choices"][0]
    assert choice["text"] == "Score this prompt" and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["token_logprobs"]) == len(ids)
    assert out["usage"]["completion_tokens"] == 0
    assert out["usage"]["prompt_tokens"] == len(ids)
    chunks = _sse(http, "/v1/completions", {"prompt": "Score this prompt", "echo": True,
                                            "max_tokens": 0})
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Score this prompt"


def test_completion_logprobs_streamed(http):
    body = {"prompt": "Hello", "max_tokens": 4, "logprobs": 2, "temperature": 0,
            "ignore_eos": True}
    whole = _post(http, "/v1/completions", body)["choices"][0]["logprobs"]
    chunks = _sse(http, "/v1/completions", body)
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert [t for p in parts for t in p["tokens"]] == whole["tokens"]
    assert [o for p in parts for o in p["text_offset"]] == whole["text_offset"]
    assert len(whole["tokens"]) == 4
    for value, top in zip(whole["token_logprobs"], whole["top_logprobs"], strict=True):
        assert value == max(top.values()) and len(top) <= 3


# -- sampling controls --------------------------------------------------------------------


def test_logit_bias_and_min_tokens_steer_the_output(http):
    token = _post(http, "/tokenize", {"prompt": " blue"})["tokens"]
    assert len(token) == 1
    out = _post(http, "/v1/completions", {"prompt": "Sky:", "max_tokens": 4, "temperature": 0,
                                          "logit_bias": {str(token[0]): 100},
                                          "ignore_eos": True})
    assert out["choices"][0]["text"] == " blue" * 4
    eos = _post(http, "/tokenize", {"prompt": "<|im_end|>"})["tokens"]
    assert len(eos) == 1
    pushed = {"prompt": "Sky:", "max_tokens": 8, "temperature": 0,
              "logit_bias": {str(eos[0]): 100}}
    out = _post(http, "/v1/completions", pushed)
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] <= 1
    out = _post(http, "/v1/chat/completions", {"messages": MESSAGES, **{
        k: v for k, v in pushed.items() if k != "prompt"}, "min_tokens": 3})
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] >= 3


def test_penalties_are_accepted_on_both_endpoints(client):
    extra = {"repetition_penalty": 1.3, "min_tokens": 1, "ignore_eos": True}
    out = client.completions.create(model=MODEL, prompt="a a a a", max_tokens=4,
                                    presence_penalty=1.5, frequency_penalty=-0.5,
                                    logit_bias={"5": -100}, extra_body=extra)
    assert out.usage.completion_tokens == 4
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                         presence_penalty=-2, frequency_penalty=2,
                                         logit_bias={"5": 50}, extra_body=extra)
    assert out.usage.completion_tokens == 4


# -- structured outputs -------------------------------------------------------------------


def test_structured_choice_and_regex(http):
    out = _post(http, "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 10, "temperature": 1.0, "seed": 3, "n": 3,
        "structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert {c["message"]["content"] for c in out["choices"]} <= {"red", "green", "blue"}
    out = _post(http, "/v1/completions", {"prompt": "Code:", "max_tokens": 10,
                                          "structured_outputs": {"regex": "[0-9]{3}-[a-c]"}})
    assert re.fullmatch("[0-9]{3}-[a-c]", out["choices"][0]["text"])


def test_response_format_json_schema_with_the_openai_parse_helper(client):
    from typing import Literal

    from pydantic import BaseModel, ConfigDict

    class Colour(BaseModel):
        # llguidance's schema option for compact JSON: JSON's flexible whitespace lets a
        # random model pad forever (a trained one closes the object)
        model_config = ConfigDict(json_schema_extra={
            "x-guidance": {"whitespace_flexible": False}})
        name: Literal["red", "green", "blue"]
        bright: bool

    out = client.chat.completions.parse(model=MODEL, messages=MESSAGES, max_tokens=40,
                                        response_format=Colour)
    parsed = out.choices[0].message.parsed
    assert isinstance(parsed, Colour)
    assert Colour.model_validate_json(out.choices[0].message.content) == parsed


# -- tokenizer routes ---------------------------------------------------------------------


def test_tokenize_round_trip_and_version(http, server):
    text = "Hello world, ünïcode ✓"
    out = _post(http, "/tokenize", {"prompt": text, "return_token_strs": True})
    assert out["count"] == len(out["tokens"]) == len(out["token_strs"])
    assert out["max_model_len"] == 256
    assert _post(http, "/detokenize", {"tokens": out["tokens"]})["prompt"] == text
    # chat messages tokenize as the chat endpoint renders them
    chat = _post(http, "/tokenize", {"messages": MESSAGES})
    usage = _post(http, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1})
    assert chat["count"] == usage["usage"]["prompt_tokens"]
    r = http.post("/tokenize", json={"prompt": "x", "model": "other"})
    assert r.status_code == 404
    r = http.post("/detokenize", json={"tokens": [10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert httpx.post(f"{server.http_url}/tokenize", json={"prompt": "x"}).status_code == 401
    version = httpx.get(f"{server.http_url}/version").json()["version"]
    assert isinstance(version, str) and version
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and info["model_max_length"] == 256


# -- gRPC ---------------------------------------------------------------------------------


def test_grpc_logprobs_in_chunks(stub):
    req = pb2.GenerateRequest(text="The capital of France is", max_tokens=5, ignore_eos=True,
                              logprobs=2, prompt_logprobs=1)
    responses = list(stub.Generate(req, metadata=AUTH, timeout=60))
    chunks = [r.chunk for r in responses if r.HasField("chunk")]
    completion = responses[-1].completion
    tokens = [t for c in chunks for t in c.token_ids]
    entries = [e for c in chunks for e in c.logprobs]
    assert len(tokens) == len(entries) == completion.usage.completion_tokens == 5
    for token, e in zip(tokens, entries, strict=True):
        assert e.token_id == token and e.logprob <= 0 and e.rank >= 1
        assert len(e.top) == 2 and e.top[0].logprob >= e.top[1].logprob
        if e.rank == 1:
            assert e.top[0].token_id == token
    prompt = chunks[0].prompt_logprobs
    assert len(prompt) == completion.usage.prompt_tokens - 1
    assert all(len(e.top) == 1 and e.logprob <= 0 for e in prompt)
    assert not any(c.prompt_logprobs for c in chunks[1:])


def test_grpc_sampling_controls_and_structured(stub):
    sampling = pb2.SamplingParams(presence_penalty=0.5, frequency_penalty=0.5,
                                  repetition_penalty=1.2, logit_bias={42: 100.0})
    responses = list(stub.Generate(pb2.GenerateRequest(
        text="hi", max_tokens=3, ignore_eos=True, sampling=sampling, min_tokens=2),
        metadata=AUTH, timeout=60))
    assert [t for r in responses if r.HasField("chunk") for t in r.chunk.token_ids] == [42] * 3
    responses = list(stub.Generate(pb2.GenerateRequest(
        text="hi", max_tokens=10, structured=pb2.StructuredOutput(
            choice=pb2.Choices(choices=["yes", "no"]))), metadata=AUTH, timeout=60))
    text = "".join(r.chunk.text for r in responses if r.HasField("chunk"))
    assert text in ("yes", "no")
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(pb2.GenerateRequest(text="hi", max_tokens=2, logprobs=30),
                           metadata=AUTH, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
