"""Fixtures of the benchmark tests: scripted fake servers on loopback (``fake_servers``)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from http.server import ThreadingHTTPServer

import grpc
import pytest

from tests.benchmarks.fake_servers import ScriptedInference, SSEHandler, pb2_grpc


@pytest.fixture(scope="module")
def fake_grpc() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    pb2_grpc.add_InferenceServicer_to_server(ScriptedInference(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


@pytest.fixture(scope="module")
def fake_http() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), SSEHandler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
