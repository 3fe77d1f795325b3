"""Helpers of the serving tests: real server processes on free ports of 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.protogen import stubs

REPO = Path(__file__).resolve().parents[2]
API_KEY = "test-key"
AUTH = (("authorization", f"Bearer {API_KEY}"),)
pb2, pb2_grpc = stubs()

# One engine shape for every server of the session, so the XLA cache is shared.
ENGINE_FLAGS = ["--max-model-len", "256", "--max-num-batched-tokens", "128",
                "--num-device-pages", "160"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m serving.cli serve`` in a subprocess, with its log kept for failures."""

    def __init__(self, model_dir: Path, cache_dir: Path, log_path: Path, *extra: str):
        self.grpc_port, self.http_port = free_port(), free_port()
        self.log_path = log_path
        self.args = [sys.executable, "-m", "serving.cli", "serve", "--model", str(model_dir),
                     "--compilation-cache", str(cache_dir), "--grpc-port", str(self.grpc_port),
                     "--http-port", str(self.http_port), *ENGINE_FLAGS, *extra]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu"}
        env.pop("SUPERINFER_API_KEY", None)
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(self.args, cwd=REPO, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT)

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def health(self, channel: grpc.Channel, service: str = "") -> int | None:
        try:
            stub = health_pb2_grpc.HealthStub(channel)
            return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1).status
        except grpc.RpcError:
            return None

    def wait_serving(self, timeout_s: float = 180.0, credentials=None) -> None:
        deadline = time.monotonic() + timeout_s
        target = self.grpc_target
        channel = (grpc.secure_channel(target, credentials) if credentials
                   else grpc.insecure_channel(target))
        with channel:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise AssertionError(f"server exited {self.proc.returncode}:\n{self.log()}")
                if self.health(channel) == health_pb2.HealthCheckResponse.SERVING:
                    return
                time.sleep(0.1)
        raise AssertionError(f"server not serving after {timeout_s} s:\n{self.log()}")

    def terminate(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def server_stats(stub) -> object:
    return stub.GetServerStats(pb2.GetServerStatsRequest(), metadata=AUTH, timeout=5)


def wait_idle(stub, timeout_s: float = 10.0) -> object:
    """Stats once nothing runs or waits; fails if pages stay allocated (a leak)."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = server_stats(stub)
        idle = s.num_running == 0 and s.num_waiting == 0
        if idle and s.device_pages_free == s.device_pages_total:
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle / pages leaked: {s}")
        time.sleep(0.05)


def write_hf_tokenizer_dir(tok: Any, path: Path, *, chat_template: bool = False) -> Path:
    """``tok`` (our tokenizer) as a Hugging Face tokenizer directory (tokenizer.json +
    tokenizer_config.json) that ``AutoTokenizer`` loads with no network: what external
    clients (guidellm, lm-eval) read to count and send the served model's token ids."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok.id_to_token(tok.bos_token_id),
        "eos_token": tok.id_to_token(tok.eos_token_ids[0]),
        "model_max_length": 256,
    }
    if chat_template:
        config["chat_template"] = tok.chat_template
    (path / "tokenizer.json").write_text(tok.to_json_str())
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path
