"""The OpenAI-compatible HTTP front through the official ``openai`` client (and raw httpx
where the wire format itself is under test)."""

from __future__ import annotations

import contextlib
import json
import time

import httpx
import openai
import pytest

from tests.serving.serving_testlib import API_KEY, AUTH, pb2, wait_idle

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key=API_KEY, max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def http(server) -> httpx.Client:
    with httpx.Client(base_url=server.http_url, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def test_completion(client):
    out = client.completions.create(model=MODEL, prompt="The capital of France is",
                                    max_tokens=8, extra_body={"ignore_eos": True})
    assert out.object == "text_completion" and out.model == MODEL
    assert out.choices[0].finish_reason == "length" and out.choices[0].text
    assert out.usage.completion_tokens == 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8


def test_completion_stream_matches_non_stream(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=10,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_completion(client):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Hello!"}],
        max_tokens=6, extra_body={"ignore_eos": True})
    assert out.object == "chat.completion"
    msg = out.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert out.usage.completion_tokens == 6 and out.usage.prompt_tokens > 10


def test_chat_stream_with_usage_in_final_chunk(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text


def test_sse_wire_format_ends_with_done(http):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "stream": True,
            "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    final = json.loads(events[-2][6:])
    assert final["choices"][0]["finish_reason"] == "length" and "superinfer" in final


def test_slo_constraints_extension(client):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
        extra_body={"ignore_eos": True, "slo_constraints": {
            "ttft_ms": 0.001, "tbt_ms": 1000, "priority_class": "critical"}})
    slo = out.model_extra["superinfer"]["slo"]
    assert slo["priority_class"] == "critical" and slo["ttft_ms"] == 0.001
    assert slo["ttft_met"] is False and slo["tbt_met"] is True and slo["met"] is False


def test_models_health_and_metrics(client, http):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert http.get("/health").json() == {"status": "serving"}
    text = http.get("/metrics").text
    for name in ("superinfer:time_to_first_token_seconds_bucket",
                 "superinfer:inter_token_latency_seconds_count",
                 "superinfer:e2e_request_latency_seconds_sum",
                 "superinfer:num_requests_running", "superinfer:num_requests_waiting",
                 "superinfer:num_requests_rotary", "superinfer:num_preemptions_total",
                 "superinfer:num_rotations_total", "superinfer:generation_tokens_total"):
        assert name in text, name
    samples = _samples(text)

    def sample(name: str, **labels: str) -> float:
        return samples[(name, *sorted({"model_name": MODEL, **labels}.items()))]

    for tier in ("device", "host"):
        assert 0 <= sample("kv_cache_usage_perc", tier=tier) <= 1
    for direction in ("to_host", "to_device"):
        assert sample("kv_bytes_moved_total", direction=direction) >= 0
    assert sample("slo_attained_total", kind="ttft") > 0
    assert sample("slo_violated_total", kind="ttft") >= 1  # the 1 µs SLO above
    assert sample("time_to_first_token_seconds_count") > 0
    assert not any(key[0].endswith("_created") for key in samples)


def _samples(text: str) -> dict[tuple, float]:
    """``{(name, *sorted (label, value) pairs): value}``, names without ``superinfer:``."""
    out = {}
    for line in text.splitlines():
        if not line.startswith("superinfer:"):
            continue
        series, value = line.rsplit(" ", 1)
        name, _, labels = series.removeprefix("superinfer:").partition("{")
        pairs = [tuple(p.split("=", 1)) for p in labels.rstrip("}").split(",") if p]
        key = (name, *sorted((k, v.strip('"')) for k, v in pairs))
        out[key] = float(value)
    return out


@contextlib.contextmanager
def _busy(stub, n: int):
    """``n`` long gRPC streams decoding: steps get slow, so nothing finishes by luck."""
    calls = [stub.Generate(pb2.GenerateRequest(text=f"Fill {i}", max_tokens=240,
                                               ignore_eos=True), metadata=AUTH, timeout=60)
             for i in range(n)]
    for call in calls:
        next(call)
    try:
        yield
    finally:
        for call in calls:
            call.cancel()


def test_client_disconnect_mid_stream_aborts(http, stub):
    body = {"model": MODEL, "prompt": "A long story", "max_tokens": 240, "stream": True,
            "ignore_eos": True}
    with _busy(stub, 15):
        aborted = _abort_count(http)
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            for _ in range(6):
                next(lines)
        _wait_aborts(http, aborted + 1)
    wait_idle(stub)


def test_non_streaming_client_gone_aborts(server, http, stub):
    """Every slot is busy, so the HTTP request waits; its client gives up, and the server
    aborts it without waiting for a slot."""
    with _busy(stub, 16):
        aborted = _abort_count(http)
        with httpx.Client(base_url=server.http_url, timeout=0.3, headers=http.headers) as c:
            with pytest.raises(httpx.TimeoutException):
                c.post("/v1/completions", json={"model": MODEL, "prompt": "Go",
                                                "max_tokens": 240, "ignore_eos": True})
        _wait_aborts(http, aborted + 1)
    wait_idle(stub)


def _abort_count(http: httpx.Client) -> float:
    samples = _samples(http.get("/metrics").text)
    key = ("request_success_total", ("finished_reason", "abort"), ("model_name", MODEL))
    return samples.get(key, 0.0)


def _wait_aborts(http: httpx.Client, count: float) -> None:
    deadline = time.monotonic() + 10
    while _abort_count(http) < count:
        assert time.monotonic() < deadline, "the abandoned request was not aborted"
        time.sleep(0.05)


def test_cache_salt_and_cached_tokens(client, http):
    """vLLM's ``cache_salt``; OpenAI's ``usage.prompt_tokens_details.cached_tokens``."""
    prompt = "HTTP prefix caching: " + "a stitch in time saves nine, " * 8
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=2,
                  extra_body={"ignore_eos": True, "cache_salt": "http-a"})
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens
    for bad in ("", "x" * 257, 5):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1,
                                               "cache_salt": bad})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "cache_salt"
    samples = _samples(http.get("/metrics").text)
    labels = (("model_name", MODEL), ("tier", "device"))
    hits = samples[("prefix_cache_hits_total", *labels)]
    assert 0 < hits <= samples[("prefix_cache_queries_total", *labels)]
