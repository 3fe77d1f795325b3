"""A server per policy for ``superinfer bench --launch``: started on free ports, waited
for until it answers, stopped after its runs."""

from __future__ import annotations

import asyncio
import os
import shlex
import subprocess
import sys
import time

from serving.bench.clients import make_backend


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_server(command: str, policy: str, backend: str, log_path: str,
                  timeout_s: float = 300.0) -> tuple[subprocess.Popen, str]:
    """Start the server command for ``policy`` and wait until it answers; returns the
    process and the benchmark target."""
    grpc_port, http_port = _free_port(), _free_port()
    argv = shlex.split(command) + ["--policy", policy, "--grpc-port", str(grpc_port),
                                   "--http-port", str(http_port)]
    if argv[0] == "superinfer":
        argv = [sys.executable, "-m", "serving.cli", *argv[1:]]
    os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
    log = open(log_path, "w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    target = f"127.0.0.1:{grpc_port}" if backend == "grpc" else f"http://127.0.0.1:{http_port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ValueError(f"server for policy {policy} exited {proc.returncode}; see "
                             f"{log_path}")
        if _answers(backend, target):
            return proc, target
        time.sleep(0.5)
    proc.kill()
    raise ValueError(f"server for policy {policy} not ready after {timeout_s:.0f} s; see "
                     f"{log_path}")


def _answers(backend: str, target: str) -> bool:
    async def probe() -> bool:
        b = make_backend(backend, target)
        try:
            await b.open()
        except ValueError:
            return False
        await b.close()
        return True

    return asyncio.run(probe())


def stop_server(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
