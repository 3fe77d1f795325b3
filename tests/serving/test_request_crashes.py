"""Regressions of the requests that used to kill the server (an int32 overflow of top_k, a
uint32 overflow of the seed, a lone surrogate, JSON nested 100,000 deep), each sent while
another client's stream is running: the bad request gets a 400 / INVALID_ARGUMENT naming
the field (or, for a seed, is served: seeds up to 2**64 - 1 are folded into the sampler's
32 bits), and the other stream completes normally, through [DONE]."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import httpx
import pytest

from tests.serving.serving_testlib import API_KEY, AUTH, pb2, wait_idle

MODEL = "tiny-llama"
BEARER = {"Authorization": f"Bearer {API_KEY}"}
STREAM_TOKENS = 48


@contextmanager
def concurrent_stream(server) -> Iterator[dict]:
    """Another client's streamed chat, running while the body of the ``with`` executes;
    on exit, waits for it and checks it ended normally."""
    result: dict = {"events": []}
    started = threading.Event()

    def stream() -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}],
                "max_tokens": STREAM_TOKENS, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", f"{server.http_url}/v1/chat/completions", json=body,
                              headers=BEARER, timeout=120) as r:
                result["status"] = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        result["events"].append(line[6:])
                        started.set()
        except Exception as e:  # reported by the assertions below
            result["error"] = repr(e)
        finally:
            started.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(60), "the concurrent stream never started"
    yield result
    thread.join(120)
    assert not thread.is_alive() and "error" not in result, result.get("error")
    events = result["events"]
    assert result["status"] == 200 and events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks
    assert chunks[-1]["usage"]["completion_tokens"] == STREAM_TOKENS
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def _chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            **fields}


HTTP_CRASHES = [
    ("top-k-2^31", _chat(top_k=2147483648), "top_k"),
    ("seed-2^64", _chat(seed=2**64), "seed"),
    ("surrogate-chat", b'{"model": "tiny-llama", "messages": [{"role": "user", '
                       b'"content": "a\\ud800b"}], "max_tokens": 4}', "messages[0].content"),
    ("surrogate-prompt", b'{"model": "tiny-llama", "prompt": "a\\ud800b", "max_tokens": 4}',
     "prompt"),
    ("nested-100000", b'{"model": "tiny-llama", "prompt": ' + b"[" * 100_000
     + b"]" * 100_000 + b"}", None),
]


@pytest.mark.parametrize("case", HTTP_CRASHES, ids=[c[0] for c in HTTP_CRASHES])
def test_http_crash_is_a_400_and_others_keep_streaming(server, case):
    _, body, param = case
    kwargs = {"content": body, "headers": {**BEARER, "Content-Type": "application/json"}} \
        if isinstance(body, bytes) else {"json": body, "headers": BEARER}
    path = "/v1/completions" if b'"prompt"' in (body if isinstance(body, bytes) else b"") \
        else "/v1/chat/completions"
    with concurrent_stream(server):
        r = httpx.post(f"{server.http_url}{path}", timeout=60, **kwargs)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


@pytest.mark.parametrize("seed", [2**32, 2**63 - 1, 2**64 - 1])
def test_http_large_seed_is_served_and_reproducible(server, seed):
    body = _chat(seed=seed, temperature=1.0, max_tokens=6, ignore_eos=True)
    with concurrent_stream(server):
        first = httpx.post(f"{server.http_url}/v1/chat/completions", json=body,
                           headers=BEARER, timeout=60)
    second = httpx.post(f"{server.http_url}/v1/chat/completions", json=body, headers=BEARER,
                        timeout=60)
    assert first.status_code == 200 and second.status_code == 200, first.text
    text = first.json()["choices"][0]["message"]["content"]
    assert text == second.json()["choices"][0]["message"]["content"]


def test_grpc_seed_2_to_the_32_is_served(server, stub):
    with concurrent_stream(server):
        out = list(stub.Generate(pb2.GenerateRequest(
            text="Hi", max_tokens=3, seed=4294967296, ignore_eos=True,
            sampling=pb2.SamplingParams(temperature=1.0)), metadata=AUTH, timeout=60))
    assert out[-1].completion.usage.completion_tokens == 3


def test_grpc_top_k_and_seed_bounds_are_invalid_argument(server, stub):
    with concurrent_stream(server):
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb2.GenerateRequest(text="Hi", max_tokens=2, seed=-1),
                               metadata=AUTH, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("seed must be in")
    # int32's top: accepted (clamped to the vocabulary), sampled like no cut at all
    out = list(stub.Generate(pb2.GenerateRequest(
        text="Hi", max_tokens=2, sampling=pb2.SamplingParams(top_k=2**31 - 1)),
        metadata=AUTH, timeout=30))
    assert out[-1].completion.usage.completion_tokens >= 1
    wait_idle(stub)
