"""Malformed requests on both fronts: each gets the right status and a message naming the
problem, and the server keeps serving afterwards with no page leaked."""

from __future__ import annotations

import grpc
import httpx
import openai
import pytest

from tests.serving.serving_testlib import API_KEY, AUTH, pb2, wait_idle

MODEL = "tiny-llama"
INVALID = grpc.StatusCode.INVALID_ARGUMENT
HUGE = "a" * (2 << 20)  # over the 1 MiB default request limit


def _req(**fields) -> pb2.GenerateRequest:
    fields.setdefault("max_tokens", 4)
    return pb2.GenerateRequest(**fields)


# (id, request: message or raw bytes, metadata, expected status, message fragment)
GRPC_CASES = [
    ("no-prompt", _req(), AUTH, INVALID, "prompt is required"),
    ("empty-text", _req(text=""), AUTH, INVALID, "prompt must not be empty"),
    ("empty-token-ids", _req(token_ids=pb2.TokenIds(ids=[])), AUTH, INVALID,
     "token_ids must not be empty"),
    ("token-over-vocab", _req(token_ids=pb2.TokenIds(ids=[1, 999_999])), AUTH, INVALID,
     "token ids must be in [0, 49152)"),
    ("negative-token", _req(token_ids=pb2.TokenIds(ids=[-3])), AUTH, INVALID,
     "token ids must be in"),
    ("negative-max-tokens", _req(text="hi", max_tokens=-5), AUTH, INVALID,
     "max_tokens must be in [1, 2147483647], got -5"),
    ("zero-max-tokens", _req(text="hi", max_tokens=0), AUTH, INVALID, "max_tokens must be in [1,"),
    ("negative-temperature", _req(text="hi", sampling=pb2.SamplingParams(temperature=-1)),
     AUTH, INVALID, "temperature must be in"),
    ("nan-temperature", _req(text="hi", sampling=pb2.SamplingParams(temperature=float("nan"))),
     AUTH, INVALID, "temperature must be a finite number"),
    ("top-p-zero", _req(text="hi", sampling=pb2.SamplingParams(top_p=0)), AUTH, INVALID,
     "top_p must be in (0, 1]"),
    ("top-p-over-one", _req(text="hi", sampling=pb2.SamplingParams(top_p=1.5)), AUTH, INVALID,
     "top_p"),
    ("top-k-below-off", _req(text="hi", sampling=pb2.SamplingParams(top_k=-2)), AUTH, INVALID,
     "top_k must be in [-1, 2147483647], got -2"),
    ("negative-seed", _req(text="hi", seed=-1), AUTH, INVALID,
     "seed must be in [0, 18446744073709551615]"),
    ("negative-ttft-slo", _req(text="hi", slo=pb2.SLO(ttft_ms=-1)), AUTH, INVALID,
     "slo.ttft_ms"),
    ("zero-tbt-slo", _req(text="hi", slo=pb2.SLO(tbt_ms=0)), AUTH, INVALID, "slo.tbt_ms"),
    ("unknown-priority", _req(text="hi", slo=pb2.SLO(priority_class=9)), AUTH, INVALID,
     "slo.priority_class"),
    ("prompt-over-max-len", _req(token_ids=pb2.TokenIds(ids=[5] * 300)), AUTH, INVALID,
     "max_model_len is 256"),
    ("bad-chat-role", _req(messages=pb2.ChatMessages(
        messages=[pb2.ChatMessage(role="wizard", content="x")])), AUTH, INVALID,
     "messages[0].role"),
    ("empty-chat", _req(messages=pb2.ChatMessages()), AUTH, INVALID, "messages must be a"),
    ("empty-stop-string", _req(text="hi", stop=[""]), AUTH, INVALID,
     "stop must hold non-empty strings"),
    ("negative-stop-token", _req(text="hi", stop_token_ids=[-1]), AUTH, INVALID,
     "stop_token_ids must be in [0, 2147483647], got -1"),
    ("stop-token-over-vocab", _req(text="hi", stop_token_ids=[49152]), AUTH, INVALID,
     "stop_token_ids must be in [0, 49152), got 49152"),
    ("logprobs-over-limit", _req(text="hi", logprobs=21), AUTH, INVALID,
     "logprobs must be in [0, 20], got 21"),
    ("prompt-logprobs-over-limit", _req(text="hi", prompt_logprobs=21), AUTH, INVALID,
     "prompt_logprobs must be in [0, 20], got 21"),
    ("logit-bias-out-of-vocab", _req(text="hi", sampling=pb2.SamplingParams(
        logit_bias={49152: 1.0})), AUTH, INVALID, "logit_bias"),
    ("logit-bias-negative-id", _req(text="hi", sampling=pb2.SamplingParams(
        logit_bias={-1: 1.0})), AUTH, INVALID, "logit_bias must be in [0,"),
    ("logit-bias-value-over-limit", _req(text="hi", sampling=pb2.SamplingParams(
        logit_bias={5: 500.0})), AUTH, INVALID, "logit_bias must be in [-100, 100]"),
    ("presence-penalty-over-limit", _req(text="hi", sampling=pb2.SamplingParams(
        presence_penalty=3)), AUTH, INVALID, "presence_penalty must be in [-2, 2]"),
    ("min-tokens-over-max-tokens", _req(text="hi", min_tokens=9), AUTH, INVALID,
     "min_tokens (9) must not exceed max_tokens (4)"),
    ("json-schema-not-json", _req(text="hi", structured=pb2.StructuredOutput(
        json_schema="{oops")), AUTH, INVALID, "structured.json_schema: not valid JSON"),
    ("invalid-json-schema", _req(text="hi", structured=pb2.StructuredOutput(
        json_schema='{"type": "nonsense"}')), AUTH, INVALID, "structured.json_schema"),
    ("uncompilable-regex", _req(text="hi", structured=pb2.StructuredOutput(
        regex="(unclosed")), AUTH, INVALID, "structured.regex"),
    ("empty-choice", _req(text="hi", structured=pb2.StructuredOutput(
        choice=pb2.Choices())), AUTH, INVALID, "structured.choice"),
    ("bad-utf8", b"\x12\x02\xff\xfe", AUTH, INVALID, "invalid UTF-8"),
    ("garbage-bytes", b"\xff\xff\xff\xff", AUTH, INVALID,
     "not a valid superinfer.v1.GenerateRequest"),
    ("unknown-field", b"\x12\x02hi\x98\x06\x01", AUTH, INVALID, "unknown field number(s) 99"),
    ("unknown-nested-field", b"\x12\x02hi\x2a\x03\xa0\x06\x01", AUTH, INVALID,
     "sampling.100"),
    ("oversize", _req(text=HUGE), AUTH, grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"),
    ("missing-api-key", _req(text="hi"), (), grpc.StatusCode.UNAUTHENTICATED,
     "missing API key"),
    ("wrong-api-key", _req(text="hi"), (("authorization", "Bearer nope"),),
     grpc.StatusCode.UNAUTHENTICATED, "invalid API key"),
]


# The field the INVALID_ARGUMENT message starts with, for the cases of issue 17.
GRPC_FIELDS = {
    "logprobs-over-limit": "logprobs", "prompt-logprobs-over-limit": "prompt_logprobs",
    "logit-bias-out-of-vocab": "logit_bias", "logit-bias-negative-id": "logit_bias",
    "logit-bias-value-over-limit": "logit_bias",
    "presence-penalty-over-limit": "presence_penalty", "min-tokens-over-max-tokens": "min_tokens",
    "json-schema-not-json": "structured.json_schema",
    "invalid-json-schema": "structured.json_schema", "uncompilable-regex": "structured.regex",
    "empty-choice": "structured.choice",
}


@pytest.mark.parametrize("case", GRPC_CASES, ids=[c[0] for c in GRPC_CASES])
def test_grpc_malformed(channel, case):
    name, request, metadata, status, fragment = case
    raw = request if isinstance(request, bytes) else request.SerializeToString()
    call = channel.unary_stream("/superinfer.v1.Inference/Generate",
                                response_deserializer=pb2.GenerateResponse.FromString)
    with pytest.raises(grpc.RpcError) as err:
        list(call(raw, metadata=metadata, timeout=30))
    assert err.value.code() == status, err.value.details()
    assert fragment in err.value.details()
    if name in GRPC_FIELDS:
        assert err.value.details().startswith(GRPC_FIELDS[name]), err.value.details()


def test_grpc_abort_without_id(stub):
    with pytest.raises(grpc.RpcError) as err:
        stub.Abort(pb2.AbortRequest(), metadata=AUTH, timeout=5)
    assert err.value.code() == INVALID and "request_id is required" in err.value.details()


def _completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 4, **fields}


def _chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


BEARER = {"Authorization": f"Bearer {API_KEY}"}
JSON = {**BEARER, "Content-Type": "application/json"}

# (id, method, path, body: dict or raw bytes, headers, status, message fragment)
HTTP_CASES = [
    ("missing-prompt", "POST", "/v1/completions", {"model": MODEL}, BEARER, 400,
     "prompt: field required"),
    ("prompt-wrong-type", "POST", "/v1/completions", _completion(prompt=42), BEARER, 400,
     "prompt"),
    ("max-tokens-string", "POST", "/v1/completions", _completion(max_tokens="ten"), BEARER,
     400, "max_tokens"),
    ("negative-max-tokens", "POST", "/v1/completions", _completion(max_tokens=-1), BEARER,
     400, "max_tokens must be in [1, 2147483647], got -1"),
    ("max-tokens-over-int32", "POST", "/v1/completions", _completion(max_tokens=2**31),
     BEARER, 400, "max_tokens must be in [1, 2147483647]"),
    ("max-completion-tokens-zero", "POST", "/v1/chat/completions",
     _chat(max_completion_tokens=0), BEARER, 400, "max_tokens must be in [1,"),
    ("top-k-over-int32", "POST", "/v1/chat/completions", _chat(top_k=2**31), BEARER, 400,
     "top_k must be in [-1, 2147483647], got 2147483648"),
    ("seed-over-uint64", "POST", "/v1/completions", _completion(seed=2**64), BEARER, 400,
     "seed must be in [0, 18446744073709551615]"),
    ("stop-token-over-vocab", "POST", "/v1/completions", _completion(stop_token_ids=[10**12]),
     BEARER, 400, "stop_token_ids must be in [0, 2147483647]"),
    ("lone-surrogate-chat", "POST", "/v1/chat/completions",
     b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "a\\ud800b"}]}', JSON,
     400, "messages[0].content: string holds a lone UTF-16 surrogate"),
    ("lone-surrogate-prompt", "POST", "/v1/completions",
     b'{"model": "tiny-llama", "prompt": "a\\udfffb", "max_tokens": 4}', JSON, 400,
     "prompt: string holds a lone UTF-16 surrogate"),
    ("deep-nesting", "POST", "/v1/completions",
     b'{"model": "tiny-llama", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", JSON, 400,
     "nests deeper than 64 levels"),
    ("int-literal-over-4300-digits", "POST", "/v1/completions",
     b'{"model": "tiny-llama", "prompt": "hi", "max_tokens": ' + b"1" * 5000 + b"}", JSON,
     400, "not valid JSON"),
    ("surrogate-in-key", "POST", "/v1/completions",
     b'{"model": "tiny-llama", "prompt": "hi", "\\ud800": 1}', JSON, 400,
     "string holds a lone UTF-16 surrogate"),
    ("too-many-stop-strings", "POST", "/v1/completions", _completion(stop=["x"] * 65),
     BEARER, 400, "stop holds 65 strings; at most 64"),
    ("too-many-stop-token-ids", "POST", "/v1/completions",
     _completion(stop_token_ids=list(range(1025))), BEARER, 400,
     "stop_token_ids holds 1025 ids; at most 1024"),
    ("moderate-nesting", "POST", "/v1/completions",
     b'{"model": "tiny-llama", "prompt": ' + b"[" * 200 + b"]" * 200 + b"}", JSON, 400,
     "nests deeper than 64 levels"),
    ("user-content-null", "POST", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": None}]), BEARER, 400,
     "messages[0].content must be a string"),
    ("tool-calls-without-template-support", "POST", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": "weather?"},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "c1", "type": "function",
                          "function": {"name": "get_weather", "arguments": "{}"}}]}]),
     BEARER, 400, "messages[1].tool_calls: this model's chat template does not render"),
    ("temperature-too-high", "POST", "/v1/completions", _completion(temperature=500), BEARER,
     400, "temperature must be in"),
    ("temperature-string", "POST", "/v1/chat/completions", _chat(temperature="hot"), BEARER,
     400, "temperature"),
    ("bad-priority", "POST", "/v1/chat/completions",
     _chat(slo_constraints={"priority_class": "vip"}), BEARER, 400, "slo.priority_class"),
    ("negative-ttft-slo", "POST", "/v1/completions",
     _completion(slo_constraints={"ttft_ms": -1}), BEARER, 400, "slo.ttft_ms"),
    ("prompt-over-max-len", "POST", "/v1/completions", _completion(prompt=[5] * 300), BEARER,
     400, "max_model_len is 256"),
    ("stream-prompt-over-max-len", "POST", "/v1/completions",
     _completion(prompt=[5] * 300, stream=True), BEARER, 400, "max_model_len is 256"),
    ("token-over-vocab", "POST", "/v1/completions", _completion(prompt=[10**7]), BEARER, 400,
     "token ids must be in"),
    ("empty-prompt", "POST", "/v1/completions", _completion(prompt=""), BEARER, 400,
     "prompt must not be empty"),
    ("too-many-prompts", "POST", "/v1/completions", _completion(prompt=["a"] * 257), BEARER,
     400, "prompt holds 257 prompts; at most 256"),
    ("invalid-json", "POST", "/v1/completions", b'{"model": ', JSON, 400, "not valid JSON"),
    ("bad-utf8", "POST", "/v1/completions", b'{"model": "\xff\xfe"}', JSON, 400,
     "not valid UTF-8"),
    ("json-array", "POST", "/v1/completions", b"[1, 2]", JSON, 400, "must be a JSON object"),
    ("oversize", "POST", "/v1/completions", _completion(prompt=HUGE), BEARER, 413,
     "limit is 1048576"),
    ("missing-api-key", "POST", "/v1/completions", _completion(), {}, 401, "missing API key"),
    ("wrong-api-key", "POST", "/v1/completions", _completion(),
     {"Authorization": "Bearer wrong"}, 401, "invalid API key"),
    ("unknown-model", "POST", "/v1/completions", _completion(model="gpt-9"), BEARER, 404,
     "model 'gpt-9' does not exist"),
    ("n-over-limit", "POST", "/v1/completions", _completion(n=17), BEARER, 400,
     "n must be in [1, 16], got 17"),
    ("n-over-limit-chat", "POST", "/v1/chat/completions", _chat(n=17), BEARER, 400,
     "n must be in [1, 16], got 17"),
    ("n-zero", "POST", "/v1/chat/completions", _chat(n=0), BEARER, 400, "n must be in"),
    ("best-of-not-n", "POST", "/v1/completions", _completion(n=2, best_of=3), BEARER, 400,
     "best_of: only best_of == n"),
    ("empty-messages", "POST", "/v1/chat/completions", _chat(messages=[]), BEARER, 400,
     "messages"),
    ("bad-role", "POST", "/v1/chat/completions",
     _chat(messages=[{"role": "wizard", "content": "x"}]), BEARER, 400, "messages[0].role"),
    ("content-wrong-type", "POST", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": 7}]), BEARER, 400, "messages[0].content"),
    ("stream-not-bool", "POST", "/v1/completions", _completion(stream="yes"), BEARER, 400,
     "stream"),
    ("top-logprobs-over-limit", "POST", "/v1/chat/completions",
     _chat(logprobs=True, top_logprobs=21), BEARER, 400,
     "top_logprobs must be in [0, 20], got 21"),
    ("top-logprobs-without-logprobs", "POST", "/v1/chat/completions", _chat(top_logprobs=2),
     BEARER, 400, "top_logprobs: only allowed when logprobs is true"),
    ("top-logprobs-with-logprobs-false", "POST", "/v1/chat/completions",
     _chat(logprobs=False, top_logprobs=0), BEARER, 400,
     "top_logprobs: only allowed when logprobs is true"),
    ("completion-logprobs-over-limit", "POST", "/v1/completions", _completion(logprobs=21),
     BEARER, 400, "logprobs must be in [0, 20], got 21"),
    ("max-tokens-zero-without-echo", "POST", "/v1/completions", _completion(max_tokens=0),
     BEARER, 400, "max_tokens must be in [1,"),
    ("logit-bias-out-of-vocab", "POST", "/v1/completions",
     _completion(logit_bias={"49152": 5}), BEARER, 400, "logit_bias"),
    ("logit-bias-key-not-an-id", "POST", "/v1/chat/completions",
     _chat(logit_bias={"hello": 5}), BEARER, 400, "logit_bias: keys are token ids"),
    ("logit-bias-value-over-limit", "POST", "/v1/completions", _completion(logit_bias={"5": 101}),
     BEARER, 400, "logit_bias must be in [-100, 100], got 101"),
    ("logit-bias-too-many", "POST", "/v1/completions",
     _completion(logit_bias={str(i): 1 for i in range(301)}), BEARER, 400,
     "logit_bias holds 301 entries; at most 300"),
    ("presence-penalty-over-limit", "POST", "/v1/chat/completions",
     _chat(presence_penalty=2.5), BEARER, 400, "presence_penalty must be in [-2, 2]"),
    ("repetition-penalty-zero", "POST", "/v1/completions", _completion(repetition_penalty=0),
     BEARER, 400, "repetition_penalty must be in (0, 10]"),
    ("min-tokens-over-max-tokens", "POST", "/v1/completions",
     _completion(min_tokens=10, max_tokens=4), BEARER, 400, "min_tokens (10) must not exceed"),
    ("invalid-json-schema", "POST", "/v1/chat/completions",
     _chat(response_format={"type": "json_schema", "json_schema": {
         "name": "x", "schema": {"type": "nonsense"}}}), BEARER, 400, "nonsense"),
    ("json-schema-missing", "POST", "/v1/chat/completions",
     _chat(response_format={"type": "json_schema"}), BEARER, 400,
     "response_format.json_schema: required"),
    ("uncompilable-regex", "POST", "/v1/completions",
     _completion(structured_outputs={"regex": "(unclosed"}), BEARER, 400, "regex"),
    ("structured-outputs-two-kinds", "POST", "/v1/completions",
     _completion(structured_outputs={"regex": "a+", "choice": ["a"]}), BEARER, 400,
     "structured_outputs: give exactly one of"),
    ("structured-outputs-json-not-json", "POST", "/v1/chat/completions",
     _chat(structured_outputs={"json": "{not json"}), BEARER, 400,
     "structured_outputs.json: not valid JSON"),
    ("structured-outputs-and-response-format", "POST", "/v1/chat/completions",
     _chat(structured_outputs={"regex": "a+"}, response_format={"type": "json_object"}),
     BEARER, 400, "give either it or response_format"),
    ("stream-options-without-stream", "POST", "/v1/completions",
     _completion(stream_options={"include_usage": True}), BEARER, 400,
     "only allowed when stream is true"),
    ("wrong-method", "GET", "/v1/completions", None, BEARER, 405,
     "no route GET /v1/completions"),
    ("unknown-route", "POST", "/v1/embeddings", _completion(), BEARER, 404,
     "no route POST /v1/embeddings"),
]


# The exact ``param`` of the cases whose field matters most to clients (issue 17).
HTTP_PARAMS = {
    "n-over-limit": "n", "n-over-limit-chat": "n", "n-zero": "n", "best-of-not-n": "best_of",
    "top-logprobs-over-limit": "top_logprobs", "top-logprobs-without-logprobs": "top_logprobs",
    "top-logprobs-with-logprobs-false": "top_logprobs",
    "completion-logprobs-over-limit": "logprobs", "max-tokens-zero-without-echo": "max_tokens",
    "logit-bias-out-of-vocab": "logit_bias", "logit-bias-key-not-an-id": "logit_bias",
    "logit-bias-value-over-limit": "logit_bias", "logit-bias-too-many": "logit_bias",
    "presence-penalty-over-limit": "presence_penalty",
    "repetition-penalty-zero": "repetition_penalty", "min-tokens-over-max-tokens": "min_tokens",
    "invalid-json-schema": "response_format.json_schema",
    "json-schema-missing": "response_format.json_schema",
    "uncompilable-regex": "structured_outputs.regex",
    "structured-outputs-two-kinds": "structured_outputs",
    "structured-outputs-json-not-json": "structured_outputs.json",
    "structured-outputs-and-response-format": "structured_outputs",
    "too-many-prompts": "prompt",
}


@pytest.mark.parametrize("case", HTTP_CASES, ids=[c[0] for c in HTTP_CASES])
def test_http_malformed(server, case):
    name, method, path, body, headers, status, fragment = case
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    with httpx.Client(base_url=server.http_url, timeout=30) as http:
        r = http.request(method, path, headers=headers, **({} if body is None else kwargs))
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert fragment in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    if status == 400 and isinstance(body, dict):  # the param names a field of the request
        assert error["param"] and error["param"].split(".")[0].split("[")[0] in {
            *body, "prompt", "messages"}, error
    if name in HTTP_PARAMS:
        assert error["param"] == HTTP_PARAMS[name], error
    if status in (429, 503):
        assert r.headers["Retry-After"].isdigit()


def test_openai_client_raises_typed_errors(server):
    good = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        good.completions.create(model=MODEL, prompt="hi", temperature=-2)
    assert "temperature" in err.value.message
    bad = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.NotFoundError):
        good.completions.create(model="nope", prompt="hi")


def test_still_serving_with_no_page_leaked(stub):
    """Runs after every malformed request above."""
    stats = wait_idle(stub)
    responses = list(stub.Generate(pb2.GenerateRequest(text="Still there?", max_tokens=5,
                                                       ignore_eos=True),
                                   metadata=AUTH, timeout=30))
    assert responses[-1].completion.usage.completion_tokens == 5
    after = wait_idle(stub)
    assert after.device_pages_free == stats.device_pages_total
