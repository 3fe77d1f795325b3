"""Paged attention: the Pallas kernel against the XLA reference, per shape.

For each head shape (Llama-3-8B: 32 query / 8 KV heads; Qwen2.5-32B: 40 / 8; head dim 128),
batch, context and mode (decode: one new token per row; prefill: a chunk per row on top of
a past), the time of the kernel and of ``attention_xla.paged_attention``, the achieved
bandwidth of each (KV bytes read / time: one layer's K and V of every row's context), their
ratio (kernel time / XLA time: < 1 means the kernel is faster) and the kernel's bandwidth as
a fraction of a large device-to-device copy measured in the same run (read + write bytes /
time). ``write_kv_ms`` is the XLA scatter of the step's new tokens, reported because the
kernel leaves the KV write to it. ``max_err`` is the kernel's largest deviation from XLA.

On a GPU this is the speed figure (the kernel compiles through the Pallas Triton backend).
On CPU the kernel runs in Pallas interpret mode: the numbers then only show that every
shape runs and agrees, not how fast the kernel is.

    python -m benchmarks.attention [--quick] [--out results/attention.json]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.lib.common import add_common_args, print_table, write_json
from superinfer_jax.ops import attention_pallas, attention_xla

HEADS = {"llama3-8b": (32, 8, 128), "qwen2.5-32b": (40, 8, 128)}  # (H, K, D)


@dataclass(frozen=True)
class Shape:
    model: str
    mode: str  # "decode" | "prefill"
    batch: int
    context: int  # KV length of every row after the step
    chunk: int  # new tokens per row (1 for decode)


def shapes(on_gpu: bool, quick: bool) -> list[Shape]:
    """GPU: batch 64, contexts 1k-32k (the issue's figure). CPU: small, interpret-mode sized."""
    if on_gpu:
        contexts = (1024, 32768) if quick else (1024, 4096, 16384, 32768)
        batch, prefill = 64, [(4, 4096, 512)]
    else:
        contexts = (64, 256) if quick else (64, 256, 1024)
        batch, prefill = 2, [(2, 256, 32)]
    out = []
    for model in HEADS:
        out += [Shape(model, "decode", batch, c, 1) for c in contexts]
        out += [Shape(model, "prefill", b, c, n) for b, c, n in prefill]
    return out


def copy_bandwidth(num_bytes: int, repeats: int = 5) -> float:
    """Bytes/s moved (read + write) by the best of a few large device-to-device copies."""
    x = jnp.ones((num_bytes // 4,), jnp.float32)  # [n]
    copy = jax.jit(lambda a: jnp.copy(a))  # output cannot alias the input: a real copy
    copy(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        copy(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * num_bytes / best


def timed(fn: Callable, args: tuple, repeats: int) -> tuple[float, jax.Array]:
    """Seconds per call: ``repeats`` calls dispatched back to back, synchronised once, so the
    host's dispatch overlaps the device's work (short kernels are not dispatch-bound)."""
    out = fn(*args)
    out.block_until_ready()  # compile and warm up
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    out.block_until_ready()
    return (time.perf_counter() - start) / repeats, out


def make_inputs(shape: Shape, dtype: str, page_size: int, seed: int = 0):
    """A one-layer pool holding every row's context in shuffled pages, and the step's q."""
    heads, kv_heads, head_dim = HEADS[shape.model]
    pages_per_row = -(-shape.context // page_size)
    num_pages = shape.batch * pages_per_row + 1
    key_pool, key_q = jax.random.split(jax.random.key(seed))
    pool = jax.random.normal(key_pool, (num_pages, 1, 2, page_size, kv_heads, head_dim),
                             dtype)  # [N, 1, 2, S, K, D]
    q = jax.random.normal(key_q, (shape.batch, shape.chunk, heads, head_dim),
                          dtype)  # [B, C, H, D]
    perm = np.random.default_rng(seed).permutation(np.arange(1, num_pages))
    tables = jnp.asarray(perm.reshape(shape.batch, pages_per_row), jnp.int32)  # [B, P]
    ctx = jnp.full((shape.batch,), shape.context, jnp.int32)  # [B]
    qlen = jnp.full((shape.batch,), shape.chunk, jnp.int32)  # [B]
    return q, pool, tables, ctx, qlen


def bench_shape(shape: Shape, dtype: str, page_size: int, repeats: int, copy_bw: float,
                tuning: dict) -> dict:
    q, pool, tables, ctx, qlen = make_inputs(shape, dtype, page_size)
    scale = q.shape[-1] ** -0.5
    fn = attention_pallas.decode_attention if shape.chunk == 1 else \
        attention_pallas.prefill_attention
    kernel = jax.jit(lambda q, p, t, c, n: fn(q, p, 0, t, c, n, scale=scale, **tuning))
    xla = jax.jit(lambda q, p, t, c, n: attention_xla.paged_attention(
        q, p, 0, t, c, n, scale=scale))
    args = (q, pool, tables, ctx, qlen)
    t_kernel, out_kernel = timed(kernel, args, repeats)
    t_xla, out_xla = timed(xla, args, repeats)
    err = float(jnp.max(jnp.abs(out_kernel.astype(jnp.float32) - out_xla.astype(jnp.float32))))

    k_new = q[:, :, : pool.shape[4]]  # [B, C, K, D]: stand-in new keys/values
    positions = (ctx - qlen)[:, None] + jnp.arange(shape.chunk)[None, :]  # [B, C]
    write = jax.jit(lambda p, k: attention_xla.write_kv(p, 0, k, k, tables, positions, qlen),
                    donate_argnums=(0,))
    pool = write(pool, k_new).block_until_ready()  # compile; the old pool is donated
    start = time.perf_counter()
    for _ in range(repeats):
        pool = write(pool, k_new)
    pool.block_until_ready()
    t_write = (time.perf_counter() - start) / repeats

    heads, kv_heads, head_dim = HEADS[shape.model]
    kv_bytes = shape.batch * shape.context * kv_heads * head_dim * 2 * jnp.dtype(dtype).itemsize
    return {
        "model": shape.model, "mode": shape.mode, "batch": shape.batch,
        "context": shape.context, "chunk": shape.chunk,
        "kernel_ms": 1e3 * t_kernel, "xla_ms": 1e3 * t_xla, "ratio": t_kernel / t_xla,
        "kernel_GBs": kv_bytes / t_kernel / 1e9, "xla_GBs": kv_bytes / t_xla / 1e9,
        "pct_copy_bw": 100 * kv_bytes / t_kernel / copy_bw,
        "write_kv_ms": 1e3 * t_write, "max_err": err,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser, "attention")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per shape")
    parser.add_argument("--block-tokens", type=int, default=64, help="keys per kernel tile")
    parser.add_argument("--num-warps", type=int, default=4, help="Triton warps per program")
    parser.add_argument("--num-stages", type=int, default=2, help="Triton pipeline stages")
    args = parser.parse_args(argv)
    tuning = {"block_tokens": args.block_tokens, "num_warps": args.num_warps,
              "num_stages": args.num_stages}

    on_gpu = jax.default_backend() == "gpu"
    repeats = args.repeats or (20 if on_gpu else 2)
    copy_bw = copy_bandwidth((2 << 30) if on_gpu else (256 << 20))
    print(f"backend {jax.default_backend()} ({'Triton' if on_gpu else 'interpret mode'}); "
          f"device copy bandwidth {copy_bw / 1e9:.1f} GB/s (read + write)")
    rows = []
    for shape in shapes(on_gpu, args.quick):
        rows.append(bench_shape(shape, args.dtype, args.page_size, repeats, copy_bw, tuning))
        print(f"  {shape.model} {shape.mode} B={shape.batch} ctx={shape.context} done",
              flush=True)
    print_table(rows, title=f"paged attention, {args.dtype}, page {args.page_size}")
    decode_long = [r for r in rows if r["mode"] == "decode" and r["context"] >= 16384]
    summary = {
        "copy_bandwidth_GBs": copy_bw / 1e9,
        "interpret_mode": not on_gpu,
        "kernel_faster_everywhere": all(r["ratio"] < 1 for r in rows),
        "long_decode_min_pct_copy_bw": min((r["pct_copy_bw"] for r in decode_long),
                                           default=None),
    }
    print("\n" + ", ".join(f"{k}={v}" for k, v in summary.items()))
    payload = {"config": vars(args), "summary": summary, "rows": rows}
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
