"""Schemathesis against the real HTTP server, generated from the server's own OpenAPI
document (``/openapi.json``): schema-conforming bodies (positive) and schema-violating ones
(negative), on both generation routes.

The property: no 5xx, ever; every 400 is OpenAI-shaped and its ``param`` names a field of
the request (one the client sent, or a required one it left out); the server answers a
normal request afterwards. An unexpected exception is a 500 by design (never a blanket
400), so it fails here.

Bounded for the suite: a fixed example budget per route and mode, derandomized (the same
examples every run). To keep the budget on parsing and validation rather than on
generating tokens, an in-range ``max_tokens`` above 4 is lowered to 4 (out-of-range values,
which must be refused, are sent as generated) and the served model name is put in
``model`` when the body has a string there (else every case would be a 404).
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from superinfer_jax.request import INT32_MAX
from tests.serving.serving_testlib import API_KEY, wait_idle

MODEL = "tiny-llama"
EXAMPLES_PER_MODE = 40
ROUTES = ("/v1/completions", "/v1/chat/completions")
MODES = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(f"{server.http_url}/openapi.json")


def _steer(body: object, repair: bool) -> None:
    """Aim a generated body at the served model and cap its in-range token budget. With
    ``repair``, also undo what the schema allows but the server refuses by design (a null
    user message, stream_options without stream, an empty prompt, tool calls, top_logprobs
    without logprobs, two structured-output kinds, min_tokens over max_tokens), so that
    about half of the positive cases reach the engine with random sampling values."""
    if not isinstance(body, dict):
        return
    if repair:
        if not body.get("stream"):
            body.pop("stream_options", None)
        if body.get("prompt") in ("", [], [[]], [""]) or isinstance(body.get("prompt"), list):
            body["prompt"] = "fuzz"
        for m in body.get("messages") or []:
            if isinstance(m, dict):
                m.pop("tool_calls", None)
                if not isinstance(m.get("content"), str | list) or not m.get("content"):
                    m["content"] = "fuzz"
        body["stop"] = [s for s in body.get("stop") or [] if s] or None
        if body["stop"] is None:
            body.pop("stop")
        if not body.get("logprobs"):
            body.pop("top_logprobs", None)  # only allowed with logprobs: true
        structured = body.get("structured_outputs")
        if structured is not None and (body.get("response_format") is not None
                                       or not isinstance(structured, dict)
                                       or len(structured) != 1):
            body.pop("structured_outputs")  # exactly one kind, and not beside response_format
    if isinstance(body.get("model"), str):
        body["model"] = MODEL
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and 4 < value <= INT32_MAX:
            body[key] = 4
    if repair:
        budget = body.get("max_tokens", body.get("max_completion_tokens"))
        low = body.get("min_tokens")
        if isinstance(low, int) and isinstance(budget, int) and low > budget:
            body.pop("min_tokens")  # min_tokens may not exceed the token budget


def _required(api_schema, route: str) -> set[str]:
    name = "ChatCompletionRequest" if "chat" in route else "CompletionRequest"
    return set(api_schema.raw_schema["components"]["schemas"][name].get("required", []))


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
@pytest.mark.parametrize("route", ROUTES)
def test_no_server_error_and_400s_name_a_field(server, stub, api_schema, route, mode):
    operation = api_schema[route]["POST"]
    required = _required(api_schema, route)
    seen: dict[int, int] = {}

    repairs = st.booleans() if mode is schemathesis.GenerationMode.POSITIVE else st.just(False)

    @settings(max_examples=EXAMPLES_PER_MODE, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode), repair=repairs)
    def one(case, repair: bool) -> None:
        _steer(case.body, repair)
        response = case.call(base_url=server.http_url,
                             headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
        status = response.status_code
        seen[status] = seen.get(status, 0) + 1
        assert status < 500, (case.body, response.text)
        if status >= 400:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, error
        if status == 400 and isinstance(case.body, dict):
            param = error["param"]
            root = (param or "").split(".")[0].split("[")[0]
            assert root in set(case.body) | required, (case.body, error)

    one()
    assert sum(seen.values()) >= EXAMPLES_PER_MODE // 2, seen
    if mode is schemathesis.GenerationMode.NEGATIVE:
        assert seen.get(400, 0) > 0, seen
    else:  # the repaired half reaches the engine
        assert seen.get(200, 0) >= EXAMPLES_PER_MODE // 5, seen
    print(f"{route} {mode.value}: statuses {dict(sorted(seen.items()))}")
    # still serving, nothing leaked
    wait_idle(stub, timeout_s=30)
    r = httpx.post(f"{server.http_url}{route}", timeout=60,
                   headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": MODEL, "max_tokens": 3, "ignore_eos": True,
                         **({"messages": [{"role": "user", "content": "still there?"}]}
                            if "chat" in route else {"prompt": "still there?"})})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
