"""Start-up: time to ready, cold and warm, and the first request's TTFT after ready.

Each case starts ``superinfer serve`` as a subprocess and polls ``/health/ready`` from
the moment the process is launched. *Cold* starts with a fresh temporary compilation
cache directory (the user's cache is never touched); *warm* restarts on the directory the
cold start filled (compiled steps and the latency profile). As soon as the server is
ready, one request is sent (a completions call with a token-id prompt, ``max_tokens`` 1:
its latency is its time to first token); then, once the server has finished its
background warm-up (its log says so), the same request is sent ``--repeats`` more times
(each with another first token, so no prefix-cache hit) and their median is the steady
state. Background compilation on (``--compile-in-background``) and off (the baseline:
every bucket compiled before ready) run in the same invocation.

The phases each start logged (fronts listening, model load, buckets, first runs,
DuplexKV, latency profile, and ``ready_cpu_s``: the server process's CPU seconds from
its start to ready) are parsed from the server's log into the JSON. Wall-clock ratios
mean something only on an idle machine; on a shared one, compare ``ready_cpu_s``.

Run time: ``--quick`` (4 step buckets, 2 resample, DuplexKV copies of at most 8 pages)
took 4 minutes for ``--modes on`` under load ~7 on 2 cores, 8 minutes for both modes
under load ~12-14 (each of its two cold starts
compiles everything once); a few minutes on an idle machine. The full run (default
config: 15 step buckets, 4 resample, DuplexKV copies up to 64 pages, a 100-token prompt)
compiles about 25 programs per cold start: expect 10-15 minutes idle on 2 cores, and far
more under load (the 32- and 64-page DuplexKV copies alone take minutes there).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any

from benchmarks.lib.common import add_common_args, print_table, write_json

READY_TIMEOUT_S = 1800.0
SETTLE_TIMEOUT_S = 1800.0
# The quick case: few buckets (decode 1-2 rows, prefill 1 row of 16 or 32 columns) and
# DuplexKV copies of at most 8 pages (staging buckets 1-8: at the default 2400-page budget
# the 32- and 64-page copies alone took minutes to compile under load, which is where the
# foreground baseline of the quick run used to stall).
QUICK_FLAGS = ["--max-num-seqs", "2", "--max-num-batched-tokens", "32", "--set",
               "engine.max_prefill_chunk=32", "--set", "engine.max_prefill_rows=1",
               "--set", "duplex_kv.transfer_budget_pages=8"]
BACKGROUND_DONE = "background warm-up done"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common_args(p, "startup")
    p.add_argument("--config", default="superinfer_config.yaml",
                   help="deployment file the server starts with")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help="prompt length of the measured request (default 100; quick 30)")
    p.add_argument("--repeats", type=int, default=None,
                   help="requests whose median is the steady-state TTFT (default 5)")
    p.add_argument("--modes", default="on,off",
                   help="background compilation on, off (the baseline), or both")
    p.add_argument("--keep-logs", default=None, help="directory for the servers' logs")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One ``superinfer serve`` process, its ports and its log."""

    def __init__(self, args: argparse.Namespace, cache_dir: str, background: bool,
                 log_path: str):
        self.http = f"http://127.0.0.1:{_free_port()}"
        argv = [sys.executable, "-m", "serving.cli", "serve", "--config", args.config,
                "--compilation-cache", cache_dir, "--grpc-port", str(_free_port()),
                "--http-port", self.http.rsplit(":", 1)[1],
                "--compile-in-background" if background else "--no-compile-in-background"]
        if args.quick:
            argv += QUICK_FLAGS
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self) -> float:
        """Seconds from launch to ``/health/ready`` answering 200."""
        deadline = self.started + READY_TIMEOUT_S
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(self.http + "/health/ready", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - self.started
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.02)
        raise RuntimeError(f"not ready after {READY_TIMEOUT_S:.0f} s; see {self.log_path}")

    def ttft_s(self, prompt: list[int]) -> float:
        """Latency of a one-token completion of ``prompt``: its time to first token."""
        body = json.dumps({"model": self.model_name(), "prompt": prompt, "max_tokens": 1,
                           "temperature": 0}).encode()
        req = urllib.request.Request(self.http + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=600) as r:
            r.read()
        return time.perf_counter() - t0

    def model_name(self) -> str:
        with urllib.request.urlopen(self.http + "/v1/models", timeout=10) as r:
            return str(json.load(r)["data"][0]["id"])

    def wait_log(self, text: str, timeout_s: float) -> bool:
        deadline = time.perf_counter() + timeout_s
        while time.perf_counter() < deadline:
            with open(self.log_path) as f:
                if text in f.read():
                    return True
            time.sleep(0.2)
        return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


_PHASES = {
    "fronts_s": r"fronts listening ([\d.]+) s after the process started",
    "load_s": r"loaded in ([\d.]+) s",
    "step_buckets_s": r"step buckets ([\d.]+) s",
    "first_runs_s": r"first runs ([\d.]+) s",
    "duplex_s": r"DuplexKV copies ([\d.]+) s",
    "latency_profile_s": r"latency profile ([\d.]+) s",
    "engine_ready_s": r"ready in ([\d.]+) s",
    "ready_cpu_s": r"ready [\d.]+ s after the process started \(([\d.]+) s CPU\)",
}


def _phases(log_path: str) -> dict[str, float]:
    """The start's phases as the server logged them (the first of each)."""
    text = open(log_path).read()
    out = {}
    for name, pattern in _PHASES.items():
        m = re.search(pattern, text)
        if m:
            out[name] = float(m.group(1))
    return out


def _prompts(n: int, length: int) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids, each with its own first token (prefix
    caching then shares nothing between them)."""
    body = [1000 + (7919 * i) % 30000 for i in range(length - 1)]
    return [[200 + k] + body for k in range(n)]


def _case(args: argparse.Namespace, cache_dir: str, background: bool, start: str,
          log_dir: str, prompts: list[list[int]]) -> dict[str, Any]:
    mode = "on" if background else "off"
    log_path = os.path.join(log_dir, f"serve-{mode}-{start}.log")
    server = Server(args, cache_dir, background, log_path)
    try:
        ready = server.wait_ready()
        first = server.ttft_s(prompts[0])
        settled = not background or server.wait_log(BACKGROUND_DONE, SETTLE_TIMEOUT_S)
        steady = [server.ttft_s(p) for p in prompts[1:]]
    finally:
        server.stop()
    median = statistics.median(steady)
    row: dict[str, Any] = {
        "background": mode, "start": start, "ready_s": ready,
        "first_ttft_ms": first * 1000, "steady_ttft_ms": median * 1000,
        "first_over_steady": first / median, "settled": settled,
    }
    row.update(_phases(log_path))
    return row


def run(args: argparse.Namespace) -> int:
    length = args.prompt_tokens or (30 if args.quick else 100)
    repeats = args.repeats or (3 if args.quick else 5)
    prompts = _prompts(repeats + 1, length)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in ("on", "off") for m in modes):
        raise ValueError(f"--modes: on, off or both, got {args.modes!r}")
    log_dir = args.keep_logs or tempfile.mkdtemp(prefix="superinfer-startup-logs-")
    os.makedirs(log_dir, exist_ok=True)
    rows = []
    for mode in modes:
        cache_dir = tempfile.mkdtemp(prefix=f"superinfer-startup-cache-{mode}-")
        try:
            for start in ("cold", "warm"):
                rows.append(_case(args, cache_dir, mode == "on", start, log_dir, prompts))
                print_table(rows[-1:], f"background compilation {mode}, {start} start")
        finally:
            shutil.rmtree(cache_dir, ignore_errors=True)
    print_table(rows, f"start-up ({'quick: ' if args.quick else ''}prompt {length} tokens, "
                      f"steady state = median of {repeats}; load average "
                      f"{os.getloadavg()[0]:.1f})")
    write_json(args.out, {"benchmark": "startup", "quick": args.quick, "config": args.config,
                          "prompt_tokens": length, "repeats": repeats,
                          "load_average": os.getloadavg(), "logs": log_dir, "rows": rows})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.startup", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
