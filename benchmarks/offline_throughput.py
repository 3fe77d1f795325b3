"""Offline throughput: this engine against transformers' ``generate`` on the same weights.

For each dtype and batch size: B prompts of ``prompt_len`` random tokens, ``new_tokens``
greedy tokens each (EOS ignored), output tokens/s end to end (prefill included) for both,
their ratio, and the engine's mean decode step time against the memory-bandwidth roofline
(weight bytes over the copy bandwidth measured in the same run).

    python -m benchmarks.offline_throughput [--quick] [--out results/offline_throughput.json]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from benchmarks.lib.common import add_common_args, print_table, write_json

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "superinfer", "xla")


def copy_bandwidth(num_bytes: int = 512 << 20, repeats: int = 5) -> float:
    """Memory traffic per second (read + write) of a large memcpy, the best of a few: the
    bandwidth a weight-streaming decode step can hope for."""
    src = np.ones(num_bytes // 4, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return 2 * num_bytes / best


def matmul_flops(n: int = 1536, repeats: int = 5) -> float:
    """FLOP/s of a large float32 matmul through XLA (the best of a few): the compute
    roofline's peak. At batch 32 a CPU decode step is compute-bound, not bandwidth-bound."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def run_engine(model, batch: int, prompts: list[list[int]], new_tokens: int, engine) -> dict:
    from superinfer_jax import SamplingParams

    sp = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    for p in prompts[:batch]:
        engine.add_request(p, sp)
    decode_times = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        s = engine.last_stats
        if s.num_prefill_tokens == 0 and s.num_decode_tokens == batch and outs:
            decode_times.append(s.step_time_s)
    elapsed = time.perf_counter() - start
    for req_id in list(engine.requests):
        engine.release(req_id)
    return {"tok_s": batch * new_tokens / elapsed,
            "decode_step_ms": 1000 * float(np.median(decode_times)) if decode_times else None}


def run_transformers(hf_model, batch: int, prompts: list[list[int]], new_tokens: int) -> float:
    import torch

    ids = torch.tensor(prompts[:batch], dtype=torch.long)
    with torch.inference_mode():
        start = time.perf_counter()
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                pad_token_id=0)
        elapsed = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + new_tokens
    return batch * new_tokens / elapsed


def baseline_setup(hf_model) -> str:
    """How the transformers baseline runs, printed over the table so a reader can tell a
    fair baseline from a hobbled one (threads, autograd, attention kernel, versions)."""
    import torch
    import transformers

    attn = getattr(hf_model.config, "_attn_implementation", None) or "default"
    return (f"transformers {transformers.__version__} on torch {torch.__version__}: "
            f"{torch.get_num_threads()} threads (cores: {os.cpu_count()}), "
            f"torch.inference_mode, attention {attn}, generate() greedy")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, "offline_throughput")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--compilation-cache", default=DEFAULT_CACHE)
    args = parser.parse_args(argv)
    if args.quick:
        args.dtypes, args.batches, args.new_tokens = "float32", "1,8", 32

    import torch

    from models import load_model
    from models.hf_export import to_transformers
    from superinfer_jax import EngineConfig, LLMEngine
    from superinfer_jax.config import default_kv_dtype

    torch.set_num_threads(os.cpu_count() or 1)
    batches = [int(b) for b in args.batches.split(",")]
    bandwidth = copy_bandwidth()
    flops = matmul_flops()
    rng = np.random.default_rng(0)
    rows = []
    setup = ""
    for dtype in args.dtypes.split(","):
        model = load_model(args.model, dtype=dtype)
        prompts = rng.integers(10, model.vocab_size, (max(batches), args.prompt_len)).tolist()
        weight_bytes = model.param_bytes()
        roofline_ms = 1000 * weight_bytes / bandwidth
        config = EngineConfig.build(
            max_model_len=args.prompt_len + args.new_tokens + 16, max_num_seqs=max(batches),
            max_prefill_chunk=args.prompt_len, max_num_batched_tokens=4 * args.prompt_len,
            dtype=default_kv_dtype(dtype), compilation_cache_dir=args.compilation_cache or None,
        )
        engine = LLMEngine(model, config)
        hf_model = to_transformers(model, dtype)
        run_transformers(hf_model, 1, prompts, 4)  # first-call overhead out of the timing
        setup = baseline_setup(hf_model)
        print(f"baseline: {setup}")
        for batch in batches:
            ours = run_engine(model, batch, prompts, args.new_tokens, engine)
            theirs = run_transformers(hf_model, batch, prompts, args.new_tokens)
            step = ours["decode_step_ms"]
            # both rooflines: weights streamed once per step, and 2 FLOPs per param per row
            compute_ms = 1000 * 2 * (weight_bytes / np.dtype(np.float32).itemsize
                                     if dtype == "float32" else weight_bytes / 2) * batch / flops
            bound_ms = max(roofline_ms, compute_ms)
            rows.append({
                "dtype": dtype, "batch": batch,
                "engine_tok_s": ours["tok_s"], "hf_tok_s": theirs,
                "ratio": ours["tok_s"] / theirs,
                "decode_step_ms": step, "bw_roofline_ms": roofline_ms,
                "flop_roofline_ms": compute_ms,
                "step_over_roofline": step / bound_ms if step else None,
            })
            print_table(rows[-1:])
        del engine, hf_model
    print_table(rows, title=f"offline throughput ({args.model}, prompt {args.prompt_len}, "
                            f"{args.new_tokens} new tokens, copy bw {bandwidth / 1e9:.1f} GB/s, "
                            f"matmul {flops / 1e9:.0f} GFLOP/s)\nbaseline: {setup}")
    write_json(args.out, {"args": vars(args), "baseline_setup": setup,
                          "copy_bandwidth_gb_s": bandwidth / 1e9,
                          "matmul_gflops": flops / 1e9, "rows": rows})


if __name__ == "__main__":
    main()
