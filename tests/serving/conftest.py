"""Fixtures of the serving tests (helpers live in ``serving_testlib``).

The model is a tiny random Llama (2 layers, hidden 64) with SmolLM2's tokenizer, saved as
an Orbax dir once per session: warm-up compiles take seconds instead of a minute, and the
persistent XLA cache shared by every server of the session makes later starts faster
still. The main server (``server``) is started once per session and shared by the gRPC,
HTTP and malformed-request modules; tests that stop a server start their own.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.serving.serving_testlib import API_KEY, ServerProcess, pb2_grpc
from tests.superinfer_jax.engine_testlib import tiny_with_tokenizer


@pytest.fixture(scope="session")
def tiny_model_dir(smollm2_tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's tokenizer, vocabulary size and special ids come from the embedded GGUF's
    metadata (``smollm2_tokenizer``): its weights are not read."""
    from models import save_orbax

    tok = smollm2_tokenizer
    model = tiny_with_tokenizer(tok, seed=0, name="tiny", max_position_embeddings=512,
                                bos_token_id=tok.bos_token_id)
    path = tmp_path_factory.mktemp("models") / "tiny-llama"
    save_orbax(model, path)
    return path


@pytest.fixture(scope="session")
def xla_cache() -> Path:
    """Persistent across runs (like the suite's own cache): later runs skip compiles."""
    root = os.environ.get("SUPERINFER_TEST_XLA_CACHE") or os.path.join(
        tempfile.gettempdir(), "superinfer-test-xla-cache")
    path = Path(root) / "serving"
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def start_server(tiny_model_dir: Path, xla_cache: Path, tmp_path_factory: pytest.TempPathFactory):
    """Factory: ``start_server(*flags)`` -> a started ServerProcess (killed at the end)."""
    started: list[ServerProcess] = []
    logs = tmp_path_factory.mktemp("server-logs")

    def start(*extra: str) -> ServerProcess:
        srv = ServerProcess(tiny_model_dir, xla_cache, logs / f"server{len(started)}.log",
                            *extra)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.kill()


@pytest.fixture(scope="session")
def server(start_server) -> Iterator[ServerProcess]:
    """The shared server: API key set, both fronts, 16 sequences per step."""
    srv = start_server("--api-key", API_KEY, "--max-num-seqs", "16")
    srv.wait_serving()
    yield srv
    assert srv.terminate() == 0, srv.log()


@pytest.fixture(scope="session")
def channel(server: ServerProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.grpc_target) as ch:
        yield ch


@pytest.fixture(scope="session")
def stub(channel: grpc.Channel):
    return pb2_grpc.InferenceStub(channel)


