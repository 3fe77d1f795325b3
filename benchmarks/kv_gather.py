"""CPU paged attention with the native KV gather against XLA's gather, per batch size.

The decode attention of every layer of SmolLM2-135M (9 query / 3 KV heads of 64, 30
layers, page 16, float32 pool), random contexts of ``--min-context`` to
``--max-context`` tokens, jitted as one program per variant: ``gather_impl="xla"`` (the
baseline, XLA:CPU's gather) and ``"auto"`` (the C++ custom call of
``superinfer_jax.ops.native``). The two variants alternate round by round in the same
process, so both see the same machine; each row reports the median of its rounds, the
ratio (native / xla: < 1 is faster), and the KV bytes read per call over the time. The
outputs of the two are checked equal bit for bit.

    python -m benchmarks.kv_gather [--quick] [--out results/kv_gather.json]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.lib.common import add_common_args, print_table, write_json
from superinfer_jax.ops import attention_xla, native

LAYERS, HEADS, KV_HEADS, HEAD_DIM, PAGE = 30, 9, 3, 64, 16


def _inputs(batch: int, min_ctx: int, max_ctx: int, seed: int):
    rng = np.random.default_rng(seed)
    max_pages = -(-max_ctx // PAGE)
    num_pages = batch * max_pages + 1
    pool = jnp.asarray(rng.standard_normal(
        (num_pages, LAYERS, 2, PAGE, KV_HEADS, HEAD_DIM), np.float32))
    tables = jnp.asarray(1 + rng.permutation(num_pages - 1).reshape(batch, max_pages),
                         jnp.int32)
    context = jnp.asarray(rng.integers(min_ctx, max_ctx + 1, batch), jnp.int32)
    query = jnp.ones(batch, jnp.int32)
    q = jnp.asarray(rng.standard_normal((batch, 1, HEADS, HEAD_DIM)), jnp.float32)
    return q, pool, tables, context, query


def _program(impl: str):
    def all_layers(q, pool, tables, context, query):
        return [attention_xla.paged_attention(q, pool, layer, tables, context, query,
                                              scale=HEAD_DIM ** -0.5, gather_impl=impl)
                for layer in range(LAYERS)]
    return jax.jit(all_layers)


def bench_batch(batch: int, args: argparse.Namespace) -> dict:
    inputs = _inputs(batch, args.min_context, args.max_context, seed=batch)
    programs = {"xla": _program("xla"), "native": _program("auto")}
    outs = {name: jax.block_until_ready(fn(*inputs)) for name, fn in programs.items()}
    same = all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(outs["xla"], outs["native"], strict=True))
    times: dict[str, list[float]] = {name: [] for name in programs}
    for _ in range(args.rounds):
        for name, fn in programs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*inputs))
            times[name].append(time.perf_counter() - t0)
    xla_ms = 1e3 * statistics.median(times["xla"])
    native_ms = 1e3 * statistics.median(times["native"])
    kv_bytes = int(np.asarray(inputs[3]).sum()) * LAYERS * 2 * KV_HEADS * HEAD_DIM * 4
    return {"batch": batch, "xla_ms": round(xla_ms, 2), "native_ms": round(native_ms, 2),
            "ratio": round(native_ms / xla_ms, 3),
            "xla_GBs": round(kv_bytes / xla_ms / 1e6, 2),
            "native_GBs": round(kv_bytes / native_ms / 1e6, 2),
            "xla_spread_ms": round(1e3 * (max(times["xla"]) - min(times["xla"])), 1),
            "native_spread_ms": round(1e3 * (max(times["native"]) - min(times["native"])), 1),
            "bitwise_equal": same}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser, "kv_gather")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--min-context", type=int, default=136)
    parser.add_argument("--max-context", type=int, default=250)
    parser.add_argument("--rounds", type=int, default=None, help="timed calls per variant")
    args = parser.parse_args(argv)
    if not native.available():
        raise SystemExit("the native gather is not available here (see the log): "
                         "nothing to compare")
    args.rounds = args.rounds or (5 if args.quick else 15)
    batches = [int(b) for b in args.batches.split(",")]
    if args.quick:
        batches = [b for b in batches if b <= 8] or batches[:1]
    rows = []
    for batch in batches:
        rows.append(bench_batch(batch, args))
        print(f"  batch {batch} done", flush=True)
    print_table(rows, title=(f"SmolLM2 decode attention, {LAYERS} layers, contexts "
                             f"{args.min_context}-{args.max_context}, float32: native KV "
                             "gather vs XLA's (medians of alternating rounds)"))
    payload = {"config": vars(args), "rows": rows,
               "summary": {"all_bitwise_equal": all(r["bitwise_equal"] for r in rows)}}
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
