"""Step-loop overlap: async scheduling (plan step t+1 while step t runs) against the
synchronous loop, on the same model, prompts and engine configuration in one run.

For each batch size: B requests of ``prompt_len`` random tokens, ``new_tokens`` greedy
tokens each. Reported per mode: output tokens/s end to end, the mean step period (wall
time over model steps), the host time per step (scheduling, rotation issue and input
building before the dispatch), and the ratio async/sync. The two modes run alternately,
``--repeats`` times each, and the best run of each counts (the machines are shared).
Greedy tokens must be identical across modes; the run fails loudly otherwise.

    python -m benchmarks.step_overlap [--quick] [--out results/step_overlap.json]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.lib.common import add_common_args, print_table, write_json
from benchmarks.offline_throughput import DEFAULT_CACHE


def run_once(engine, prompts: list[list[int]], new_tokens: int) -> dict:
    from superinfer_jax import SamplingParams

    sp = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    steps0, host0 = engine.num_model_steps, engine.total_host_time_s
    start = time.perf_counter()
    ids = [engine.add_request(p, sp) for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
    elapsed = time.perf_counter() - start
    steps = engine.num_model_steps - steps0
    tokens = [engine.release(i).output_token_ids for i in ids]
    return {"tok_s": len(prompts) * new_tokens / elapsed, "steps": steps,
            "step_ms": 1000 * elapsed / steps,
            "host_ms": 1000 * (engine.total_host_time_s - host0) / steps, "tokens": tokens}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, "step_overlap")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--policy", default="fcfs", help="scheduling policy of both engines")
    parser.add_argument("--compilation-cache", default=DEFAULT_CACHE)
    args = parser.parse_args(argv)
    if args.quick:
        args.batches, args.new_tokens, args.repeats = "1,8", 24, 2

    from models import load_model
    from superinfer_jax import EngineConfig, LLMEngine

    batches = [int(b) for b in args.batches.split(",")]
    model = load_model(args.model, dtype="float32")
    rng = np.random.default_rng(0)
    prompts = rng.integers(10, model.vocab_size, (max(batches), args.prompt_len)).tolist()
    base = EngineConfig.build(max_model_len=args.prompt_len + args.new_tokens + 16,
                              max_num_seqs=max(batches), policy=args.policy,
                              host_memory_gb=0.25 if args.policy != "fcfs" else 0.0,
                              compilation_cache_dir=args.compilation_cache or None)
    engines = {mode: LLMEngine(model, base.replace(async_scheduling=mode == "async"))
               for mode in ("sync", "async")}
    rows = []
    for batch in batches:
        best: dict[str, dict] = {}
        for _ in range(args.repeats):
            for mode, engine in engines.items():
                run = run_once(engine, prompts[:batch], args.new_tokens)
                if mode not in best or run["tok_s"] > best[mode]["tok_s"]:
                    best[mode] = run
        if best["sync"]["tokens"] != best["async"]["tokens"]:
            raise SystemExit(f"batch {batch}: async and sync generated different tokens")
        for mode in ("sync", "async"):
            r = best[mode]
            rows.append({"batch": batch, "mode": mode, "tok_s": r["tok_s"],
                         "step_ms": r["step_ms"], "host_ms": r["host_ms"],
                         "steps": r["steps"],
                         "speedup": r["tok_s"] / best["sync"]["tok_s"]})
    print_table(rows, f"step overlap, {args.model} float32, prompt {args.prompt_len}, "
                      f"{args.new_tokens} new tokens, best of {args.repeats}")
    write_json(args.out, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
