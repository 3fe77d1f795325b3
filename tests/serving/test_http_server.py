"""The OpenAI-compatible HTTP front through the official ``openai`` client (and raw httpx
where the wire format itself is under test)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator

import grpc
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serving.serving_testlib import API_KEY, AUTH, pb2, server_stats, wait_idle

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


def _series(text: str, prefix: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """(name without ``prefix``, labels, value) of each ``prefix`` sample, parsed by
    prometheus-client's own exposition parser."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(prefix):
                yield sample.name.removeprefix(prefix), sample.labels, sample.value


def _samples(text: str) -> dict[tuple, float]:
    """``{(name, *sorted (label, value) pairs): value}``, names without ``superinfer:``."""
    return {(name, *sorted(labels.items())): value
            for name, labels, value in _series(text, "superinfer:")}


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


def _vllm_samples(text: str) -> dict[str, tuple[dict[str, str], float]]:
    """``{name: (labels, value)}`` of the ``vllm:`` series (one series per name)."""
    return {name: (labels, value) for name, labels, value in _series(text, "vllm:")}


def test_vllm_gauges_track_engine_under_burst(http, stub):
    """GIE's endpoint-picker gauges: same numbers as GetServerStats, under load and idle."""
    info = stub.GetModelInfo(pb2.GetModelInfoRequest(), metadata=AUTH, timeout=5)
    n = 20  # 16 sequences per step: 4 wait
    calls = [stub.Generate(pb2.GenerateRequest(text=f"Burst {i}", max_tokens=240,
                                               ignore_eos=True), metadata=AUTH, timeout=60)
             for i in range(n)]
    try:
        deadline = time.monotonic() + 30
        while True:  # every request admitted and some tokens out
            s = server_stats(stub)
            if s.num_running + s.num_waiting == n and s.device_pages_free < s.device_pages_total:
                break
            assert time.monotonic() < deadline, s
            time.sleep(0.02)
        for _ in range(50):  # a scrape between two stats snapshots with the same queues
            before = server_stats(stub)
            text = http.get("/metrics").text
            after = server_stats(stub)
            if (before.num_running, before.num_waiting) == (after.num_running,
                                                             after.num_waiting):
                break
        else:
            pytest.fail("the queues never held still across a scrape")
        v = _vllm_samples(text)
        assert v["num_requests_running"] == ({"model_name": MODEL}, before.num_running)
        assert v["num_requests_waiting"] == ({"model_name": MODEL}, before.num_waiting)
        assert before.num_running > 0 and before.num_waiting > 0, before
        assert before.num_running + before.num_waiting == n
        used = [(s.device_pages_total - s.device_pages_free) / s.device_pages_total
                for s in (before, after)]
        labels, usage = v["kv_cache_usage_perc"]
        assert labels == {"model_name": MODEL}
        assert 0 < used[0] <= usage <= used[1] < 1, (used, usage)  # pages only grow here
        assert v["gpu_cache_usage_perc"] == (labels, usage)  # the pre-v1 name
        assert v["cache_config_info"] == ({"model_name": MODEL, "block_size": str(info.page_size),
                                           "num_gpu_blocks": str(before.device_pages_total),
                                           "cache_dtype": info.kv_cache_dtype}, 1)
        # the superinfer: gauges say the same
        sup = _samples(text)
        assert sup[("num_requests_running", ("model_name", MODEL))] == before.num_running
        assert sup[("kv_pages_total", ("model_name", MODEL), ("tier", "device"))] == \
            before.device_pages_total
        assert sup[("kv_pages_total", ("model_name", MODEL), ("tier", "host"))] == \
            before.host_pages_total
        assert sup[("num_requests_rotary", ("model_name", MODEL))] >= 0
    finally:
        for call in calls:
            call.cancel()
    idle = wait_idle(stub)
    v = _vllm_samples(http.get("/metrics").text)
    assert v["num_requests_running"][1] == v["num_requests_waiting"][1] == 0
    assert v["kv_cache_usage_perc"][1] == 0.0  # cached unreferenced pages count as free
    sup = _samples(http.get("/metrics").text)
    assert sup[("kv_pages_used", ("model_name", MODEL), ("tier", "device"))] == 0
    assert sup[("prefix_cache_pages", ("model_name", MODEL), ("tier", "device"))] == \
        idle.engine_stats["prefix_cache_pages"]
    assert sup[("prefix_cache_pages", ("model_name", MODEL), ("tier", "host"))] == \
        idle.engine_stats["prefix_cache_host_pages"]
    # vLLM's counters: the device tier, and the host tier as its "external" cache
    queries, hits = v["prefix_cache_queries_total"][1], v["prefix_cache_hits_total"][1]
    assert queries == idle.engine_stats["prefix_cache_queries"] > 0
    assert hits == idle.engine_stats["prefix_cache_hits"] <= queries
    assert v["external_prefix_cache_queries_total"][1] == queries - hits
    assert v["external_prefix_cache_hits_total"][1] == \
        idle.engine_stats["prefix_cache_host_hits"]


def _slo_of(http: httpx.Client, headers: dict[str, str], body_slo: dict | None = None) -> dict:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    if body_slo is not None:
        body["slo_constraints"] = body_slo
    r = http.post("/v1/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()["superinfer"]["slo"]


def test_slo_headers_and_precedence(http):
    llmd = {"x-llm-d-slo-ttft-ms": "1234", "x-llm-d-slo-tpot-ms": "56.5"}
    older = {"x-slo-ttft-ms": "999", "x-slo-tpot-ms": "99"}
    default = _slo_of(http, {})
    slo = _slo_of(http, llmd)
    assert (slo["ttft_ms"], slo["tbt_ms"]) == (1234, 56.5)
    slo = _slo_of(http, older)
    assert (slo["ttft_ms"], slo["tbt_ms"]) == (999, 99)
    slo = _slo_of(http, {**older, **llmd})  # llm-d's names win
    assert (slo["ttft_ms"], slo["tbt_ms"]) == (1234, 56.5)
    slo = _slo_of(http, {"x-slo-tpot-ms": "77"})  # one field: the other is the default
    assert (slo["ttft_ms"], slo["tbt_ms"]) == (default["ttft_ms"], 77)
    slo = _slo_of(http, llmd, {"ttft_ms": 777})  # field by field, the body wins
    assert (slo["ttft_ms"], slo["tbt_ms"]) == (777, 56.5)
    slo = _slo_of(http, llmd, {"ttft_ms": 777, "tbt_ms": 11, "priority_class": "batch"})
    assert (slo["ttft_ms"], slo["tbt_ms"], slo["priority_class"]) == (777, 11, "batch")
    for name in ("x-llm-d-slo-ttft-ms", "x-slo-tpot-ms"):
        for bad in ("abc", "nan", "inf", "-5", "0", "1e12", ""):
            r = http.post("/v1/chat/completions", headers={name: bad}, json={
                "model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 1})
            assert r.status_code == 400, (name, bad, r.text)
            err = r.json()["error"]
            assert err["param"] == name and name in err["message"], err
    # a bad older header is refused even when the llm-d one would win
    r = http.post("/v1/completions", headers={**llmd, "x-slo-ttft-ms": "soon"},
                  json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-slo-ttft-ms"


def test_slo_metadata_on_grpc(stub):
    def slo_of(*metadata: tuple[str, str], **slo: float):
        req = pb2.GenerateRequest(text="Hi", max_tokens=1, slo=pb2.SLO(**slo))
        out = list(stub.Generate(req, metadata=AUTH + metadata, timeout=30))
        return out[-1].completion.slo

    slo = slo_of(("x-llm-d-slo-ttft-ms", "1234"), ("x-slo-ttft-ms", "9"),
                 ("x-slo-tpot-ms", "44"))
    assert (slo.ttft_ms, slo.tbt_ms) == (1234, 44)
    slo = slo_of(("x-llm-d-slo-tpot-ms", "33"), ttft_ms=555)
    assert (slo.ttft_ms, slo.tbt_ms) == (555, 33)
    with pytest.raises(grpc.RpcError) as err:
        slo_of(("x-llm-d-slo-tpot-ms", "fast"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "x-llm-d-slo-tpot-ms" in err.value.details()
