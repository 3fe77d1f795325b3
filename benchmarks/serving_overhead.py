"""Serving overhead: what the gRPC and HTTP fronts add on top of the in-process engine.

The same requests (random prompts of ``prompt_len`` token ids, ``max_tokens`` greedy
tokens each, EOS ignored) run three ways, each as a closed loop of ``concurrency``
clients:

- ``engine``: in this process, through ``AsyncEngine`` (the loop the server runs), so the
  only difference left to the fronts is serialization, the network stack and the front's
  own threads;
- ``grpc``: a ``superinfer serve`` subprocess, streaming ``Generate`` calls;
- ``http``: the same server, streaming ``/v1/completions`` (SSE) over httpx.

TTFT is measured at the client (submit to first token received), throughput as output
tokens over wall time. The engine runs alone, then the server, never both at once.

    python -m benchmarks.serving_overhead [--quick] [--out results/serving_overhead.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from benchmarks.lib.common import add_common_args, print_table, write_json

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "superinfer", "xla")
REPO = Path(__file__).resolve().parents[1]

# (ttft seconds, output tokens) of one request
Result = tuple[float, int]


def tiny_model(path: Path) -> str:
    """A 2-layer random Llama with SmolLM2's tokenizer: the fronts' cost, not the model's."""
    from models import ModelConfig, load_model, random_servable, save_orbax

    smol = load_model("smollm2-135m")
    cfg = ModelConfig(name="tiny", vocab_size=smol.config.vocab_size, hidden_size=64,
                      intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True,
                      eos_token_ids=smol.config.eos_token_ids)
    save_orbax(random_servable(cfg, tokenizer=smol.tokenizer), path)
    return str(path)


def deployment(args: argparse.Namespace, model_ref: str) -> dict[str, object]:
    """The deployment keys both the in-process engine and the server get."""
    model_key = "model.path" if os.path.exists(model_ref) else "model.name"
    return {model_key: model_ref,
            "model.max_model_len": args.prompt_len + args.max_tokens + 16,
            "engine.max_num_seqs": args.concurrency,
            "engine.max_num_batched_tokens": max(256, args.prompt_len),
            "hardware.compilation_cache_dir": args.compilation_cache}


def closed_loop(one: Callable[[list[int]], Result], prompts: list[list[int]],
                concurrency: int) -> tuple[list[Result], float]:
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, prompts))
    return results, time.perf_counter() - start


def summarize(mode: str, results: list[Result], wall_s: float) -> dict:
    ttft_ms = 1000 * np.array([r[0] for r in results])
    tokens = sum(r[1] for r in results)
    return {"mode": mode, "requests": len(results), "ttft_p50_ms": float(np.median(ttft_ms)),
            "ttft_mean_ms": float(ttft_ms.mean()), "ttft_p90_ms": float(np.percentile(ttft_ms, 90)),
            "tok_s": tokens / wall_s, "wall_s": wall_s}


# -- the three clients ----------------------------------------------------------------


def run_engine(args: argparse.Namespace, model_ref: str, prompts: list[list[int]]) -> dict:
    from models import load_model
    from serving.deploy_config import DeploymentConfig
    from superinfer_jax.async_engine import AsyncEngine
    from superinfer_jax.engine import LLMEngine
    from superinfer_jax.request import SamplingParams

    cfg = DeploymentConfig.load(None, deployment(args, model_ref))
    model = load_model(cfg.model.source)
    engine = AsyncEngine(LLMEngine(model, cfg.engine_config(show_progress=False)))
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)

    def one(prompt: list[int]) -> Result:
        t0 = time.perf_counter()
        ttft, n = None, 0
        for out in engine.submit(prompt, sp):
            if out.new_token_ids and ttft is None:
                ttft = time.perf_counter() - t0
            n += len(out.new_token_ids)
        return ttft, n

    try:
        closed_loop(one, prompts[: args.concurrency], args.concurrency)  # first-call costs
        return summarize("engine", *closed_loop(one, prompts, args.concurrency))
    finally:
        engine.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, model_ref: str, log_path: Path):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    grpc_port, http_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "serving.cli", "serve", "--grpc-port", str(grpc_port),
           "--http-port", str(http_port)]
    for key, value in deployment(args, model_ref).items():
        cmd += ["--set", f"{key}={value}"]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
        health = health_pb2_grpc.HealthStub(ch)
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start; see {log_path}")
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    return proc, grpc_port, http_port


def run_grpc(args: argparse.Namespace, port: int, prompts: list[list[int]]) -> dict:
    import grpc

    from serving.protogen import stubs

    pb2, pb2_grpc = stubs()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb2_grpc.InferenceStub(channel)

        def one(prompt: list[int]) -> Result:
            req = pb2.GenerateRequest(token_ids=pb2.TokenIds(ids=prompt),
                                      max_tokens=args.max_tokens, ignore_eos=True)
            t0 = time.perf_counter()
            ttft, n = None, 0
            for r in stub.Generate(req, timeout=600):
                if r.chunk.token_ids and ttft is None:
                    ttft = time.perf_counter() - t0
                n += len(r.chunk.token_ids)
            return ttft, n

        closed_loop(one, prompts[: args.concurrency], args.concurrency)
        return summarize("grpc", *closed_loop(one, prompts, args.concurrency))


def run_http(args: argparse.Namespace, port: int, model_name: str,
             prompts: list[list[int]]) -> dict:
    import httpx

    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600,
                      limits=httpx.Limits(max_connections=args.concurrency)) as http:

        def one(prompt: list[int]) -> Result:
            body = {"model": model_name, "prompt": prompt, "max_tokens": args.max_tokens,
                    "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            t0 = time.perf_counter()
            ttft, n = None, 0
            with http.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if ttft is None and chunk["choices"] and chunk["choices"][0]["text"]:
                        ttft = time.perf_counter() - t0
                    if chunk.get("usage"):
                        n = chunk["usage"]["completion_tokens"]
            return ttft, n

        closed_loop(one, prompts[: args.concurrency], args.concurrency)
        return summarize("http", *closed_loop(one, prompts, args.concurrency))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, "serving_overhead")
    parser.add_argument("--model", default=None,
                        help="model to serve (default: smollm2-135m; --quick: a tiny random "
                             "Llama)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--compilation-cache", default=DEFAULT_CACHE)
    args = parser.parse_args(argv)
    if args.quick:
        args.num_requests, args.concurrency, args.prompt_len, args.max_tokens = 32, 4, 32, 32

    with tempfile.TemporaryDirectory(prefix="serving-overhead-") as tmp:
        tmp_path = Path(tmp)
        model_ref = args.model or (tiny_model(tmp_path / "tiny-llama") if args.quick
                                   else "smollm2-135m")
        model_name = Path(model_ref).name if os.path.exists(model_ref) else model_ref
        rng = np.random.default_rng(0)
        prompts = rng.integers(10, 40000, (args.num_requests, args.prompt_len)).tolist()
        rows = [run_engine(args, model_ref, prompts)]
        print_table(rows[-1:])
        proc, grpc_port, http_port = start_server(args, model_ref, tmp_path / "server.log")
        try:
            rows.append(run_grpc(args, grpc_port, prompts))
            print_table(rows[-1:])
            rows.append(run_http(args, http_port, model_name, prompts))
            print_table(rows[-1:])
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    base = rows[0]
    for row in rows:
        row["ttft_overhead_ms"] = row["ttft_p50_ms"] - base["ttft_p50_ms"]
        row["tok_s_vs_engine"] = row["tok_s"] / base["tok_s"]
    print_table(rows, title=f"serving overhead ({model_name}, {args.num_requests} requests, "
                            f"concurrency {args.concurrency}, prompt {args.prompt_len}, "
                            f"{args.max_tokens} new tokens)")
    write_json(args.out, {"args": vars(args), "model": model_name, "rows": rows})


if __name__ == "__main__":
    main()
