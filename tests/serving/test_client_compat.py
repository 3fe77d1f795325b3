"""What real clients send and expect, beyond the strict OpenAI core: vendor extensions
(unknown fields accepted and logged; refused only in strict mode), vLLM's
``continuous_usage_stats``, tool-call conversations, OpenAI finish reasons, the published
OpenAPI document, and gRPC health ``List``."""

from __future__ import annotations

import json

import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.serving.serving_testlib import API_KEY

MODEL = "tiny-llama"
BEARER = {"Authorization": f"Bearer {API_KEY}"}


def _chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
            "ignore_eos": True, **fields}


def _sse(http_url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{http_url}{path}", json=body, headers=BEARER, timeout=60) as r:
        assert r.status_code == 200, r.read()
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_unknown_fields_are_ignored_and_logged_once(server):
    body = _chat(stream=True, stream_options={"include_usage": True, "vendor_knob": 1},
                 some_extension={"a": 1}, messages=[
                     {"role": "user", "content": "Hi", "audio_hint": "x"}])
    for _ in range(2):
        chunks = _sse(server.http_url, "/v1/chat/completions", body)
        assert chunks[-1]["usage"]["completion_tokens"] == 3
    log = server.log()
    for name in ("some_extension", "stream_options.vendor_knob", "messages[].audio_hint"):
        assert log.count(f"ignoring unknown request field '{name}'") == 1, log


def test_strict_mode_refuses_unknown_fields(start_server):
    srv = start_server("--set", "server.strict_request_fields=true", "--max-num-seqs", "4")
    srv.wait_serving()
    try:
        r = httpx.post(f"{srv.http_url}/v1/completions", timeout=30,
                       json={"model": MODEL, "prompt": "hi", "max_token": 5})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "max_token"
        assert "max_token: unknown field" in r.json()["error"]["message"]
        r = httpx.post(f"{srv.http_url}/v1/chat/completions", timeout=30,
                       json=_chat(slo_constraints={"ttft": 5}))
        assert r.status_code == 400 and r.json()["error"]["param"] == "slo_constraints.ttft"
    finally:
        assert srv.terminate() == 0, srv.log()


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", _chat(max_tokens=5)),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 5, "ignore_eos": True}),
])
def test_continuous_usage_stats_in_every_chunk(server, path, body):
    body = {**body, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = _sse(server.http_url, path, body)
    assert all(c["usage"] is not None for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 5
    prompt = {c["usage"]["prompt_tokens"] for c in chunks}
    assert len(prompt) == 1 and prompt.pop() > 0
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"]
               + c["usage"]["completion_tokens"] for c in chunks)
    assert chunks[-1]["choices"] == []  # include_usage's final chunk stays


def test_tool_message_with_tool_call_id_and_null_assistant_content(server):
    messages = [{"role": "user", "content": "What is the weather?"},
                {"role": "assistant", "content": None},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = httpx.post(f"{server.http_url}/v1/chat/completions", headers=BEARER, timeout=60,
                   json=_chat(messages=messages))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


def test_finish_reasons_are_openai_values_with_the_engine_reason_kept(server):
    r = httpx.post(f"{server.http_url}/v1/chat/completions", headers=BEARER, timeout=60,
                   json=_chat())
    out = r.json()
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["superinfer"]["finish_reason"] == "length"
    from serving.openai_schema import openai_finish_reason
    assert openai_finish_reason("abort") == "length"  # cut short: the text is incomplete
    assert {openai_finish_reason(r) for r in ("stop", "length", "abort")} <= {
        "stop", "length", "content_filter", "tool_calls", "function_call"}


def test_openapi_document_carries_request_schemas(server):
    doc = httpx.get(f"{server.http_url}/openapi.json", timeout=30).json()
    for path, model in (("/v1/completions", "CompletionRequest"),
                        ("/v1/chat/completions", "ChatCompletionRequest")):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"]["$ref"] == f"#/components/schemas/{model}"
    schemas = doc["components"]["schemas"]
    top_k = schemas["CompletionRequest"]["properties"]["top_k"]
    assert top_k["minimum"] == -1 and top_k["maximum"] == 2**31 - 1
    assert schemas["ChatCompletionRequest"]["properties"]["seed"]["maximum"] == 2**64 - 1
    assert "ChatMessage" in schemas and "SLOConstraints" in schemas
    assert httpx.get(f"{server.http_url}/docs", timeout=30).status_code == 200


def test_grpc_health_list(channel):
    health = health_pb2_grpc.HealthStub(channel)
    reply = health.List(health_pb2.HealthListRequest(), timeout=5)
    serving = health_pb2.HealthCheckResponse.SERVING
    assert reply.statuses[""].status == serving
    assert reply.statuses["superinfer.v1.Inference"].status == serving


def test_tool_calls_render_through_a_template_that_supports_them():
    from models.tokenizer import compile_chat_template
    from serving.requests import encode_prompt

    class ToolTemplateTokenizer:
        chat_template = (
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
            "{% for c in m.tool_calls or [] %}[call {{ c.id }} {{ c.function.name }}"
            "({{ c.function.arguments }})]{% endfor %}"
            "{% if m.tool_call_id %}[for {{ m.tool_call_id }}]{% endif %}{% endfor %}")

        def apply_chat_template(self, messages, add_generation_prompt=True):
            return compile_chat_template(self.chat_template).render(messages=messages)

        def encode(self, text: str) -> list[int]:
            self.text = text
            return [1]

    tok = ToolTemplateTokenizer()
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    encode_prompt(tok, messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
    assert tok.text == ('<user>Weather?<assistant>[call c1 get_weather({"city": "Paris"})]'
                        "<tool>sunny[for c1]")
