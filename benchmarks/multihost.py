"""TP=4 over two processes against TP=4 in one process, on the same CPU.

Both runs use the same random Llama-style model, prompts and engine configuration; the
two-process run is two processes on 127.0.0.1 with 2 virtual CPU devices each and XLA's
gloo collectives (``superinfer_jax.dist.multihost``: process 0 runs the engine, process 1
replays its device calls), the one-process run has 4 virtual devices and no channel.
Reported per run: output tokens/s over a timed round (after a warm-up round that compiles
everything), ms per model step, the collective time per step (a jitted program with
exactly the step's collectives, ``2 * layers`` all-reduces of ``[B, 1, hidden]`` and the
all-gathers of ``[B, 1, hidden]`` and ``[B, vocab]``, timed alone), and, two-process only,
the messages and bytes process 0 sent per step. Greedy tokens must be identical in both
runs; the benchmark fails loudly otherwise.

The numbers are a CPU artefact (gloo over loopback TCP against XLA:CPU's in-process
collectives, on cores shared by both processes), but a regression in the channel or the
replay shows.

    python -m benchmarks.multihost [--quick] [--out results/multihost.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.lib.common import add_common_args, print_table, write_json
from benchmarks.step_overlap import run_once

TP = 4
SIZES = {  # (vocab, hidden, ffn, layers, heads, kv_heads, head_dim)
    "quick": (1024, 128, 256, 2, 8, 4, 16),
    "full": (8192, 512, 1024, 8, 16, 8, 32),
}


def _model_config(size: str):
    from models.config import ModelConfig

    vocab, hidden, ffn, layers, heads, kv, head_dim = SIZES[size]
    return ModelConfig(name=f"bench-{size}", vocab_size=vocab, hidden_size=hidden,
                       intermediate_size=ffn, num_layers=layers, num_heads=heads,
                       num_kv_heads=kv, head_dim=head_dim, max_position_embeddings=512)


def _engine_config(batch: int):
    from superinfer_jax import EngineConfig

    return EngineConfig.build(max_model_len=256, max_num_seqs=batch, max_num_batched_tokens=256,
                              max_prefill_chunk=64, max_prefill_rows=1, page_size=16,
                              num_device_pages=batch * 16 + 1, num_host_pages=0,
                              attention_backend="xla", show_progress=False, warmup=True,
                              tensor_parallel_size=TP, policy="fcfs")


def _prompts(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab, prompt_len).tolist() for _ in range(batch)]


def _collective_ms(mesh, cfg, batch: int, repeats: int) -> float:
    """The step's collectives alone, on the engine's mesh (every process runs this the
    same number of times before the engine starts: it needs no tape)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from superinfer_jax.dist.parallel import TP_AXIS

    def body(h, logits):
        for _ in range(2 * cfg.num_layers):  # after wo and after w_down, every layer
            h = jax.lax.psum(h, TP_AXIS) * 0.5
        gathered = jax.lax.all_gather(h, TP_AXIS, axis=2, tiled=True)
        vocab = jax.lax.all_gather(logits, TP_AXIS, axis=1, tiled=True)
        return gathered.sum() + vocab.sum()

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(None, TP_AXIS)),
                               out_specs=P(), check_vma=False))
    # numpy in: across processes, a process-local jax.Array cannot be put on the mesh
    h = jax.device_put(np.ones((batch, 1, cfg.hidden_size), np.float32),
                       NamedSharding(mesh, P()))
    logits = jax.device_put(np.ones((batch, cfg.vocab_size), np.float32),
                            NamedSharding(mesh, P(None, TP_AXIS)))
    fn(h, logits).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn(h, logits).block_until_ready()
        times.append(time.perf_counter() - t)
    return 1000 * sorted(times)[len(times) // 2]


def worker(args: argparse.Namespace) -> int:
    """One process of a run: ``--num-processes 1`` alone, or one of a group."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", TP // args.num_processes)
    from models.servable import random_servable
    from superinfer_jax.dist.parallel import make_mesh

    cfg = _model_config(args.size)
    config = _engine_config(args.batch)
    group = recorder = None
    if args.num_processes > 1:
        from superinfer_jax.dist.distributed import DistributedConfig
        from superinfer_jax.dist.multihost import start_group

        dist = DistributedConfig(args.coordinator, args.num_processes, args.process_id)
        group = start_group(dist, config)
    mesh = make_mesh(TP)
    collective_ms = _collective_ms(mesh, cfg, args.batch, 20)
    model = random_servable(cfg, seed=0, mesh=mesh)
    if group is not None and not group.is_leader:
        from superinfer_jax.dist.multihost import follow

        follow(model, config, group)
        return 0
    if group is not None:
        from superinfer_jax.dist.multihost import leader_engine

        engine, recorder = leader_engine(model, config, group)
    else:
        from superinfer_jax import LLMEngine

        engine = LLMEngine(model, config)
    prompts = _prompts(args.batch, args.prompt_len, cfg.vocab_size)
    run_once(engine, prompts, args.new_tokens)  # warm-up: every shape compiled once
    sent0 = recorder.sent if recorder else 0
    bytes0 = recorder.bytes_sent if recorder else 0
    run = run_once(engine, prompts, args.new_tokens)
    out = {"processes": args.num_processes, "tok_s": run["tok_s"], "step_ms": run["step_ms"],
           "collective_ms_per_step": collective_ms, "steps": run["steps"],
           "tokens": run["tokens"]}
    if recorder is not None:
        out["messages_per_step"] = (recorder.sent - sent0) / run["steps"]
        out["kib_per_step"] = (recorder.bytes_sent - bytes0) / 1024 / run["steps"]
        recorder.stop()
    Path(args.worker_out).write_text(json.dumps(out))
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(args: argparse.Namespace, num_processes: int, out: Path) -> dict[str, Any]:
    base = [sys.executable, "-m", "benchmarks.multihost", "--worker", "--size", args.size,
            "--batch", str(args.batch), "--prompt-len", str(args.prompt_len),
            "--new-tokens", str(args.new_tokens), "--num-processes", str(num_processes),
            "--worker-out", str(out)]
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen(base + ["--coordinator", f"127.0.0.1:{port}",
                                      "--process-id", str(p)], env=env)
             for p in range(num_processes)]
    codes = [p.wait(timeout=args.timeout) for p in procs]
    if any(codes):
        raise SystemExit(f"{num_processes}-process run failed: exit codes {codes}")
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, "multihost")
    parser.add_argument("--size", choices=tuple(SIZES), default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=1800, help="per run, seconds")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--num-processes", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = args.quick
    args.size = args.size or ("quick" if quick else "full")
    args.batch = args.batch or (4 if quick else 16)
    args.prompt_len = args.prompt_len or (16 if quick else 64)
    args.new_tokens = args.new_tokens or (16 if quick else 64)
    if args.worker:
        sys.exit(worker(args))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in (1, 2):
            rows.append(_launch(args, n, Path(tmp) / f"{n}.json"))
    if rows[0]["tokens"] != rows[1]["tokens"]:
        raise SystemExit("greedy tokens differ between the one- and two-process runs")
    table = [{k: v for k, v in r.items() if k != "tokens"} for r in rows]
    table[1]["tok_s_ratio"] = rows[1]["tok_s"] / rows[0]["tok_s"]
    print_table(table, f"TP={TP}, {args.size} model, batch {args.batch}, prompt "
                f"{args.prompt_len}, {args.new_tokens} new tokens (CPU, virtual devices)")
    write_json(args.out, {"args": vars(args), "rows": table, "tokens_equal": True})


if __name__ == "__main__":
    main()
