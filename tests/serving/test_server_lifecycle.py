"""Server lifecycle, each test on its own server: warm-up health, SIGTERM drain, admission
limits, TLS. These stop their server, so they never share the session's."""

from __future__ import annotations

import shutil
import signal
import ssl
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2

from tests.serving.serving_testlib import ServerProcess, pb2, pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
FAST_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.min_reconnect_backoff_ms", 50),
                  ("grpc.max_reconnect_backoff_ms", 100)]


def _long_stream(stub, results: dict, key: str, first: threading.Event, **kw) -> None:
    """Run one long Generate, record its completion (or error), flag the first chunk."""
    try:
        for r in stub.Generate(pb2.GenerateRequest(text=f"Story {key}", max_tokens=200,
                                                   ignore_eos=True), timeout=120, **kw):
            first.set()
            if r.WhichOneof("kind") == "completion":
                results[key] = r.completion
    except grpc.RpcError as e:
        results[key] = e
        first.set()


def _http_health(url: str) -> list[httpx.Response]:
    """``/health/live``, ``/health/ready``, ``/health``; none while HTTP is not up yet."""
    try:
        return [httpx.get(f"{url}{path}", timeout=5)
                for path in ("/health/live", "/health/ready", "/health")]
    except httpx.ConnectError:
        return []


def test_warmup_health_then_sigterm_drains_in_flight(start_server):
    srv = start_server("--max-num-seqs", "16")
    statuses: list[int] = []
    warming_refusals: list[str] = []
    http_warming: list[httpx.Response] = []
    with grpc.insecure_channel(srv.grpc_target, options=FAST_RECONNECT) as channel:
        stub = pb2_grpc.InferenceStub(channel)
        deadline = time.monotonic() + 180
        while SERVING not in statuses:
            assert time.monotonic() < deadline and srv.proc.poll() is None, srv.log()
            status = srv.health(channel)
            if status is not None and (not statuses or statuses[-1] != status):
                statuses.append(status)
            if status == NOT_SERVING and not warming_refusals:
                with pytest.raises(grpc.RpcError) as err:
                    list(stub.Generate(pb2.GenerateRequest(text="hi"), timeout=5))
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                warming_refusals.append(err.value.details())
            if status == NOT_SERVING and not http_warming:
                seen = _http_health(srv.http_url)
                if seen and all(r.json() == {"status": "warming_up"} for r in seen):
                    http_warming.extend(seen)  # (not if SERVING came between the three)
            time.sleep(0.02)
        assert statuses == [NOT_SERVING, SERVING], srv.log()
        for path in ("/health/live", "/health/ready", "/health"):
            r = httpx.get(f"{srv.http_url}{path}", timeout=5)
            assert r.status_code == 200 and r.json() == {"status": "serving"}, (path, r.text)
        assert "warming up" in warming_refusals[0]
        # HTTP starts (after gRPC) before the model loads: live, not ready
        assert http_warming, "HTTP was never seen warming up"
        live, ready, old = http_warming
        assert live.status_code == 200 and live.json() == {"status": "warming_up"}
        assert ready.status_code == 503 and ready.headers["Retry-After"] == "5"
        assert ready.json() == old.json() == {"status": "warming_up"}
        assert old.status_code == 503

        results: dict = {}
        first = threading.Event()
        threads = [threading.Thread(target=_long_stream, args=(stub, results, str(i), first))
                   for i in range(32)]
        for t in threads:
            t.start()
        assert first.wait(60)
        deadline = time.monotonic() + 30
        while True:  # every request admitted (running or waiting) before the signal
            s = stub.GetServerStats(pb2.GetServerStatsRequest(), timeout=5)
            if s.num_running + s.num_waiting + len(results) >= 32:
                break
            assert time.monotonic() < deadline, s
        srv.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while srv.health(channel) != NOT_SERVING:
            assert time.monotonic() < deadline, "health still SERVING after SIGTERM"
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb2.GenerateRequest(text="late"), timeout=5))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "draining" in err.value.details()
        r = httpx.post(f"{srv.http_url}/v1/completions",
                       json={"model": "tiny-llama", "prompt": "late"}, timeout=5)
        assert r.status_code == 503 and "draining" in r.json()["error"]["message"]
        assert r.headers["Retry-After"] == "5"
        # draining: not ready (the gateway stops routing here), but alive (no restart)
        ready = httpx.get(f"{srv.http_url}/health/ready", timeout=5)
        assert ready.status_code == 503 and ready.headers["Retry-After"] == "5"
        assert ready.json() == {"status": "draining"}
        live = httpx.get(f"{srv.http_url}/health/live", timeout=5)
        assert live.status_code == 200 and live.json() == {"status": "draining"}
        assert httpx.get(f"{srv.http_url}/health", timeout=5).status_code == 503
        for t in threads:
            t.join(120)
    assert srv.terminate() == 0, srv.log()
    assert len(results) == 32
    for done in results.values():
        assert not isinstance(done, Exception), done
        assert done.finish_reason == pb2.FINISH_REASON_LENGTH
        assert done.usage.completion_tokens == 200


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


def test_tls_admission_limit_and_drain_grace(start_server, tls_files):
    cert, key = tls_files
    srv = start_server("--tls-cert", str(cert), "--tls-key", str(key), "--max-num-seqs", "1",
                       "--max-queue-len", "1", "--drain-grace-s", "0")
    creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    srv.wait_serving(credentials=creds)
    verify = ssl.create_default_context(cafile=str(cert))
    http = openai.OpenAI(base_url=f"https://127.0.0.1:{srv.http_port}/v1", api_key="x",
                         max_retries=0, http_client=httpx.Client(verify=verify))
    with grpc.secure_channel(srv.grpc_target, creds) as channel:
        stub = pb2_grpc.InferenceStub(channel)
        # TLS on both fronts.
        done = list(stub.Generate(pb2.GenerateRequest(text="hi", max_tokens=2), timeout=30))
        assert done[-1].completion.usage.completion_tokens == 2
        assert http.completions.create(model="tiny-llama", prompt="hi", max_tokens=2).usage

        # One running, one waiting: everything else is refused, on both fronts.
        def grpc_call(i: int) -> str:
            try:
                list(stub.Generate(pb2.GenerateRequest(text=f"q{i}", max_tokens=200,
                                                       ignore_eos=True), timeout=60))
                return "ok"
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
                assert "admission queue is full" in e.details()
                return "full"

        def http_call(i: int) -> str:
            try:
                http.completions.create(model="tiny-llama", prompt=f"q{i}", max_tokens=200,
                                        extra_body={"ignore_eos": True})
                return "ok"
            except openai.RateLimitError as e:
                assert "admission queue is full" in e.message
                assert e.response.headers["Retry-After"] == "1"
                return "full"

        with ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(grpc_call if i % 2 else http_call, i) for i in range(16)]
            outcomes = [f.result() for f in futures]
        assert "ok" in outcomes
        assert "full" in outcomes[0::2] and "full" in outcomes[1::2], outcomes

        # Grace 0: SIGTERM aborts what is in flight, and the stream says so.
        results: dict = {}
        first = threading.Event()
        t = threading.Thread(target=_long_stream, args=(stub, results, "last", first))
        t.start()
        assert first.wait(30)
        srv.proc.send_signal(signal.SIGTERM)
        t.join(30)
    assert srv.terminate() == 0, srv.log()
    assert results["last"].finish_reason == pb2.FINISH_REASON_ABORT


def test_sigterm_while_compiling_in_the_background_exits_cleanly(tiny_model_dir, tmp_path):
    """Ready comes before the last bucket is compiled; a server stopped then waits for the
    compile under way instead of exiting from inside XLA (which aborted the process with
    "terminate called ..." and a signal instead of exit code 0). A fresh compilation
    cache, so the background compiles are real ones."""
    srv = ServerProcess(tiny_model_dir, tmp_path / "xla-cache", tmp_path / "server.log",
                        "--compile-in-background")
    try:
        srv.wait_serving()
        assert srv.terminate(timeout_s=300) == 0, srv.log()
    finally:
        srv.kill()
    log = srv.log_path.read_text(errors="replace")
    assert "background warm-up done" not in log  # precondition: stopped mid-warm-up
    assert "terminate called" not in log, log[-3000:]
