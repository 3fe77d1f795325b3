"""How failures reach clients once a request is admitted, on the HTTP front in process
(over a fake engine loop whose failures are scripted; the real server's paths are the
same code): an engine that goes down ends every stream with an ``error`` event and
``[DONE]`` (never a silent cut) and a waiting non-streaming request with a 503 and
``Retry-After``; a request the engine failed alone gets an error event, or a 500 without
streaming, while its neighbours finish."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from serving.deploy_config import DeploymentConfig
from serving.http_server import OpenAIFront
from serving.runtime import Runtime
from superinfer_jax.async_engine import AsyncEngine
from superinfer_jax.engine import RequestOutput
from tests.serving.fake_engine_testlib import FakeEngine

MODEL = "smollm2-135m"


class FailingOneEngine(FakeEngine):
    """Fails request ``victim`` alone at its second token, as the real engine does when
    one request's host work raises."""

    def __init__(self, victim: str, **kw):
        super().__init__(**kw)
        self.victim = victim

    def step(self) -> list[RequestOutput]:
        outputs = super().step()
        for i, out in enumerate(outputs):
            req = out.request
            if req.req_id.endswith(self.victim) and len(req.output_token_ids) == 2:
                self.abort_request(req.req_id)
                outputs[i] = RequestOutput(req.req_id, [], "", True, "abort", req,
                                           error="request failed in the engine: boom")
        return outputs


def _client(fake: FakeEngine) -> tuple[TestClient, AsyncEngine]:
    runtime = Runtime(DeploymentConfig.from_dict(None))
    fake.config = SimpleNamespace(
        model=SimpleNamespace(max_model_len=64, kv_cache_dtype="float32"),
        hardware=SimpleNamespace(page_size=16),
        engine=SimpleNamespace(policy="fcfs"))
    loop = AsyncEngine(fake)
    model = SimpleNamespace(tokenizer=None, vocab_size=100, dtype="float32",
                            eos_token_ids=(0,))
    runtime.set_serving(loop, model)
    return TestClient(OpenAIFront(runtime).app), loop


def _events(body: str) -> list[str]:
    return [line[6:] for line in body.splitlines() if line.startswith("data: ")]


@pytest.fixture
def engines():
    made: list[AsyncEngine] = []
    yield made
    for loop in made:
        loop.stop()


def test_engine_down_mid_stream_ends_with_error_event_and_done(engines):
    client, loop = _client(FakeEngine(max_running=4, step_s=0.01, fail_at_step=4))
    engines.append(loop)
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3],
                                             "max_tokens": 50, "stream": True})
    assert r.status_code == 200
    events = _events(r.text)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "engine failed: RuntimeError: device on fire" in error["message"]
    assert error["type"] == "service_unavailable_error"
    assert any("choices" in json.loads(e) for e in events[:-2])  # it had started
    later = client.post("/v1/completions", json={"model": MODEL, "prompt": [1],
                                                 "max_tokens": 2})
    assert later.status_code == 503 and later.headers["Retry-After"] == "5"


def test_engine_down_fails_a_waiting_non_streaming_request_with_503(engines):
    client, loop = _client(FakeEngine(max_running=4, step_s=0.01, fail_at_step=3))
    engines.append(loop)
    r = client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 50,
                                                  "messages": [{"role": "user",
                                                                "content": "x"}]})
    # no tokenizer in this fake model: the chat prompt cannot be built, a clean 400
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": [4, 5],
                                             "max_tokens": 50})
    assert r.status_code == 503, r.text
    assert "device on fire" in r.json()["error"]["message"]
    assert r.headers["Retry-After"] == "5"


def test_one_failed_request_gets_an_error_and_the_others_finish(engines):
    client, loop = _client(FailingOneEngine(victim="", max_running=4, step_s=0.0))
    engines.append(loop)
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2],
                                             "max_tokens": 5, "stream": True})
    events = _events(r.text)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "engine_error" and "boom" in error["message"]
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2],
                                             "max_tokens": 5})
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
    loop.engine.victim = "never"
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2],
                                             "max_tokens": 5})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
