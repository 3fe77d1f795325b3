"""Mixture-of-experts speed on CPU: the grouped matmul, the MoE decode step, its bytes,
and transformers' ``generate`` on the same checkpoint.

One random Mixtral (16 experts, top-2, hidden 512, expert intermediate 512, 4 layers,
vocab 1024 by default), built by transformers and saved with ``save_pretrained``
(``benchmarks.lib.moe_generate``); bfloat16 and float32; four tables:

(a) ``grouped``: one expert projection at batch 32 (32 tokens x top-k rows, routed by a
    random router): ``ops.grouped_matmul`` (the native kernel on CPU), its XLA path and
    ``ragged_dot``, against a dense all-experts einsum (every token times every expert);
    ``dense_over_native`` is the speed-up (the issue asks >= 2x where experts >= 4x top-k).
(b) ``step``: the decode step of the checkpoint loaded by ``models.load_model``
    (``models.moe`` in the engine's forward, paged attention) at batch 1, 8 and 32,
    against the dense model with the same active parameters (same attention, intermediate
    size = top-k x expert size); ``moe_over_dense`` is the ratio (the issue asks <= 1.3x).
    The per-expert counts' host callback is off while timing, as in serving.
(c) ``bytes``: per step, the expert weights the grouped matmul reads against the bytes of
    the experts the batch was actually routed to (``read_over_routed``: 1 means each routed
    expert is read once and no other), and the step's bytes (weights read + KV) against the
    dense model's, which explains (b)'s ratio: a batch routed to most experts reads most
    of them. Routing comes from the model's own per-expert counts on one probe step.
(d) ``generate``: greedy decoding of ``--new-tokens`` tokens at batch 1 (and 8 unless
    ``--quick``) from the checkpoint in this engine (``LLMEngine``) and in transformers
    (``from_pretrained``, torch CPU, ``generate``): tok/s each, their ratio, and how many
    leading tokens agree.

Variants alternate round by round in one process; medians, and for (b) the fastest call
of each too (on a loaded machine the least disturbed one).

    python -m benchmarks.moe [--quick] [--out results/moe.json]

On a machine shared with other work, one thread per program gives steadier ratios (a
helper thread waiting for a core no longer decides the step):
``XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.lib.common import add_common_args, print_table, write_json
from benchmarks.lib.moe_generate import MoEShape, dense_twin, generate_row, write_mixtral
from models import load_model
from models.expert_counts import ExpertCounts
from models.servable import LlamaServable, random_servable
from superinfer_jax.kv.layout import PoolLayout
from superinfer_jax.model_api import StepInputs
from superinfer_jax.ops import native
from superinfer_jax.ops.grouped_matmul import grouped_matmul, grouped_matmul_reference

PAGE = 16


def _medians(fns: dict[str, Callable[[], object]], rounds: int,
             best: dict[str, float] | None = None) -> dict[str, float]:
    """Milliseconds per call of each thunk (already compiled), alternating, medians; the
    fastest call of each into ``best`` (on a loaded machine, the least disturbed one)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t0)
    if best is not None:
        best.update({name: 1e3 * min(ts) for name, ts in times.items()})
    return {name: 1e3 * statistics.median(ts) for name, ts in times.items()}


def bench_grouped(dtype: str, shape: MoEShape, batch: int, rounds: int) -> dict:
    """(a): one expert projection, [batch * top_k, hidden] x [E, hidden, F]."""
    rng = np.random.default_rng(0)
    e, k, f, hidden = shape.experts, shape.top_k, shape.expert_size, shape.hidden
    tokens = jnp.asarray(rng.standard_normal((batch, hidden), np.float32), dtype)
    w = jnp.asarray(rng.standard_normal((e, hidden, f), np.float32) * 0.02, dtype)
    chosen = jax.lax.top_k(jnp.asarray(rng.standard_normal((batch, e)), jnp.float32), k)[1]
    order = jnp.argsort(chosen.reshape(-1), stable=True)
    sizes = jnp.bincount(chosen.reshape(-1), length=e).astype(jnp.int32)
    rows = tokens[order // k]  # [batch * k, hidden], sorted by expert
    f32 = jnp.float32
    programs = {
        name: jax.jit(lambda x, w, s, impl=impl: grouped_matmul(
            x, w, s, preferred_element_type=f32, impl=impl))
        for name, impl in (("native", "auto"), ("xla", "xla"), ("ragged_dot", "ragged_dot"))}
    if not native.grouped_matmul_available(dtype):
        del programs["native"]
    dense = jax.jit(lambda t, w: jnp.einsum("th,ehf->etf", t, w, preferred_element_type=f32))
    fns: dict[str, Callable[[], object]] = {
        name: (lambda p=p: p(rows, w, sizes)) for name, p in programs.items()}
    fns["dense_einsum"] = lambda: dense(tokens, w)
    ref = grouped_matmul_reference(rows, w, sizes)
    err = {name: float(jnp.max(jnp.abs(p(rows, w, sizes) - ref))) for name, p in programs.items()}
    jax.block_until_ready(fns["dense_einsum"]())
    ms = _medians(fns, rounds)
    row = {"dtype": dtype, "experts": e, "top_k": k, "batch": batch, "rows": batch * k,
           "routed": int(jnp.sum(sizes > 0)), **{f"{n}_ms": round(v, 3) for n, v in ms.items()}}
    if "native" in ms:
        row["dense_over_native"] = round(ms["dense_einsum"] / ms["native"], 2)
    row["dense_over_xla"] = round(ms["dense_einsum"] / ms["xla"], 2)
    row["max_err"] = max(err.values())
    return row


def _decode(model: LlamaServable, batch: int, context: int, seed: int):
    """A jitted decode step (pool donated) and its inputs: every row ``context`` tokens in."""
    pages = -(-context // PAGE)
    layout = PoolLayout(model.kv_spec, PAGE, "float32" if model.acc32 else model.compute_dtype)
    pool = layout.zeros(batch * pages + 1)
    rng = np.random.default_rng(seed)
    inputs = StepInputs.from_numpy(
        tokens=rng.integers(0, model.vocab_size, (batch, 1)),
        positions=np.full((batch, 1), context - 1), query_lens=np.ones(batch),
        context_lens=np.full(batch, context),
        page_tables=1 + np.arange(batch * pages).reshape(batch, pages))
    step = jax.jit(lambda p, pool, x: model.forward(p, pool, x), donate_argnums=(1,))
    state = {"pool": pool}

    def run() -> jax.Array:
        logits, state["pool"] = step(model.params, state["pool"], inputs)
        return logits
    jax.block_until_ready(run())
    return run, inputs


def _param_bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))



def bench_step(moe: LlamaServable, batch: int, args: argparse.Namespace) -> dict:
    """(b) and (c) at one batch size: ``moe`` loaded from the checkpoint, against a random
    dense model with its active parameters."""
    dense = random_servable(dense_twin(moe.config), dtype=moe.dtype, seed=1)
    routed = routed_experts(moe, batch, args.context)
    runs = {"moe": _decode(moe, batch, args.context, seed=batch)[0],
            "dense": _decode(dense, batch, args.context, seed=batch)[0]}
    best: dict[str, float] = {}
    ms = _medians(runs, args.rounds, best)
    row = {"dtype": moe.dtype, "batch": batch, **{f"{n}_ms": round(v, 3) for n, v in ms.items()},
           **{f"{n}_best_ms": round(best[n], 3) for n in ("moe", "dense")},
           "moe_over_dense": round(ms["moe"] / ms["dense"], 2),
           "best_moe_over_dense": round(best["moe"] / best["dense"], 2)}
    return {**row, **step_bytes(moe, dense, routed, batch, args.context)}


def routed_experts(moe: LlamaServable, batch: int, context: int) -> np.ndarray:
    """Tokens per expert of each routed layer ([layers, experts]) in the timed step: the
    same model and inputs, run once with the model's per-expert counts on. Leaves the
    counts off (``expert_counts = None``: no host callback in the step), as serving does."""
    cfg = moe.config
    assert cfg.moe is not None
    moe.expert_counts = ExpertCounts(cfg.moe_layers, cfg.moe.num_experts)
    try:
        _decode(moe, batch, context, seed=batch)  # compiles and runs once
        return moe.expert_counts.snapshot()
    finally:
        moe.expert_counts = None


def step_bytes(moe: LlamaServable, dense: LlamaServable, routed: np.ndarray, batch: int,
               context: int) -> dict:
    """(c): weights each step reads (embedding rows aside: one row per token) plus KV."""
    cfg = moe.config
    assert cfg.moe is not None
    itemsize = jnp.dtype(moe.dtype).itemsize
    expert = 3 * cfg.hidden_size * cfg.moe.intermediate_size * itemsize
    per_layer = (routed > 0).sum(axis=1)
    experts_total = expert * cfg.moe.num_experts * len(cfg.moe_layers)
    routed_bytes = expert * int(per_layer.sum())
    embed = cfg.vocab_size * cfg.hidden_size * itemsize
    kv_width = 4 if moe.acc32 else itemsize  # the pool's dtype (float32 on the CPU bf16 path)
    kv = batch * context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * kv_width
    moe_other = moe.param_bytes() - experts_total - embed
    dense_step = dense.param_bytes() - embed + kv
    moe_step = moe_other + routed_bytes + kv
    return {"experts_routed": "/".join(str(int(n)) for n in per_layer),
            "routed_MB": round(routed_bytes / 1e6, 2),
            "read_over_routed": 1.0,  # the grouped matmul: each routed expert once
            "ragged_read_over_routed": round(experts_total / routed_bytes, 2),
            "moe_step_MB": round(moe_step / 1e6, 2), "dense_step_MB": round(dense_step / 1e6, 2),
            "moe_over_dense_bytes": round(moe_step / dense_step, 2)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser, "moe")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--expert-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=128, help="KV tokens per row")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--rounds", type=int, default=None, help="timed calls per variant")
    parser.add_argument("--new-tokens", type=int, default=None,
                        help="greedy tokens per row in (d) (default 64, 16 with --quick)")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens in (d)")
    parser.add_argument("--generate-batches", default=None,
                        help="batch sizes of (d) (default 1,8; 1 with --quick)")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (5 if args.quick else 15)
    args.new_tokens = args.new_tokens or (16 if args.quick else 64)
    args.generate_batches = args.generate_batches or ("1" if args.quick else "1,8")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    shape = MoEShape(args.experts, args.top_k, args.hidden, args.expert_size, args.layers)
    dtypes = args.dtypes.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    if args.quick:  # the smallest and the largest batch
        batches = sorted({min(batches), max(batches)})
    print(f"backend {jax.default_backend()}; native grouped matmul: "
          + ", ".join(f"{d} {native.grouped_matmul_available(d)}" for d in dtypes))

    grouped = [bench_grouped(d, shape, 32, args.rounds) for d in dtypes]
    print_table(grouped, title=f"(a) grouped matmul, one [{32 * args.top_k}, {args.hidden}] x "
                f"[{args.experts}, {args.hidden}, {args.expert_size}] projection at batch 32 "
                "(ms, medians)")
    steps, generate = [], []
    with tempfile.TemporaryDirectory(prefix="moe_bench_") as tmp:
        path = write_mixtral(Path(tmp), shape)
        for d in dtypes:
            moe = load_model(path, dtype=d)
            for b in batches:
                steps.append(bench_step(moe, b, args))
                print(f"  step {d} batch {b} done", flush=True)
            for b in (int(b) for b in args.generate_batches.split(",")):
                generate.append(generate_row(path, moe, b, args.prompt_len, args.new_tokens))
                print(f"  generate {d} batch {b} done", flush=True)
    timing = [{k: r[k] for k in r if k.endswith("_ms") or k.endswith("over_dense")
               or k in ("dtype", "batch")} for r in steps]
    print_table(timing, title=f"(b) decode step, {args.layers} layers, {args.experts} experts "
                f"top-{args.top_k} vs dense intermediate {args.top_k * args.expert_size}, "
                f"context {args.context} (ms, medians and fastest calls)")
    print_table([{k: r[k] for k in r if k not in timing[0] or k in ("dtype", "batch")}
                 for r in steps], title="(c) bytes per step (weights read + KV)")
    print_table([{k: v for k, v in r.items() if k != "hf_setup"} for r in generate],
                title=f"(d) greedy decoding, prompt {args.prompt_len}, "
                f"{args.new_tokens} new tokens: this engine vs transformers generate (tok/s)")
    if generate:
        print(f"transformers: {generate[0]['hf_setup']}")
    summary = {
        "grouped_min_dense_over_native": min((r.get("dense_over_native", 0) for r in grouped),
                                             default=None),
        "step_max_moe_over_dense": max(r["moe_over_dense"] for r in steps),
        "step_max_best_moe_over_dense": max(r["best_moe_over_dense"] for r in steps),
        "generate_min_engine_over_hf": min((r["engine_over_hf"] for r in generate),
                                           default=None),
    }
    print("\n" + ", ".join(f"{k}={v}" for k, v in summary.items()))
    payload = {"config": vars(args), "load_average": os.getloadavg(), "summary": summary,
               "grouped": grouped, "steps": steps, "generate": generate}
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
