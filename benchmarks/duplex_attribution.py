"""Where a rotation's added step time goes: ``benchmarks.duplex``'s overlap rig (SmolLM2
random f32, decode batch 8; 16 pages each way with ``--quick``, else 32), one rig in the
``fused`` copy mode, with every piece of a rotating step timed on the host:

  scatter program, gather program   the jitted copies (on CPU they run inline, in the
                                    calling thread, so their call time is their run time)
  poll / execute host               ``DuplexKV.poll`` and ``execute`` less those programs
  bookkeeping                       ``rotate_out`` and ``rotate_in``
  step                              the model step's call and wait, over the step alone

against three costs of the same bytes (one copy each way): the floor at the run's memcpy
ceiling (``benchmarks.duplex``: 1 GiB, which glibc copies with non-temporal stores),
numpy copying the same bytes in one piece right after a step (the benchmark's
interleaved floor), and numpy copying the same pages one by one between a pool and page
arrays after every step, as the rotation does (``numpy pages``: a perfect copy in the
step loop). Steps alone, rotating and with numpy pages are interleaved in short runs and
medians are reported. Goal (issue #16): rotating adds at most 1.2x the floor.

    python -m benchmarks.duplex_attribution [--quick] [--rounds 8]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

import superinfer_jax.duplexkv.rotation as rotation
from benchmarks.duplex import OverlapRig, keep_freed_memory, memcpy_gbps, overlap_setup
from benchmarks.lib.common import add_common_args, print_table, write_json


def timed(fn: Callable[..., Any], acc: dict[str, float], key: str) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[key] += time.perf_counter() - t
    return wrapper


def attribution(quick: bool, rounds: int, memcpy_GBps: float) -> dict[str, Any]:
    model, batch, ctx, rot, step = overlap_setup(quick)
    rig = OverlapRig(model, batch, ctx, rot, "fused")
    rig.run(step, model.params, True, 3)  # compile, warm both paths
    rig.run(step, model.params, False, 3)
    acc: dict[str, float] = defaultdict(float)
    duplex, mover = rig.duplex, rig.duplex.mover
    # instance attributes: this rig's only
    mover._gather = timed(mover._gather, acc, "gather")  # type: ignore[assignment]
    mover._scatter = timed(mover._scatter, acc, "scatter")  # type: ignore[assignment]
    duplex.poll = timed(duplex.poll, acc, "poll")  # type: ignore[method-assign]
    duplex.execute = timed(duplex.execute, acc, "execute")  # type: ignore[method-assign]
    for name in ("rotate_out", "rotate_in"):
        setattr(rig.kv, name, timed(getattr(rig.kv, name), acc, "bookkeeping"))
    arrived = rotation._arrived
    rotation._arrived = timed(arrived, acc, "arrived")  # type: ignore[assignment]

    page_shape = rig.layout.page_shape()
    pool = np.zeros((rig.kv.allocator.num_pages, *page_shape), np.float32)
    page_sets = [[np.ones(page_shape, np.float32) for _ in range(rot)] for _ in range(3)]
    rot_bytes = rot * rig.layout.page_bytes
    src, dst = np.ones(2 * rot_bytes, np.uint8), np.ones(2 * rot_bytes, np.uint8)
    clock = time.perf_counter

    def numpy_pages_step(k: int) -> float:
        t = clock()
        out, arriving = page_sets[k % 3], page_sets[(k + 1) % 3]
        for i in range(rot):  # in: host pages into freed pool pages; out: pool pages
            pool[1 + i] = arriving[i]
        for i in range(rot):
            np.copyto(out[i], pool[1 + rot + i])
        tok, rig.pool = step(model.params, rig.pool, rig.x)
        tok.block_until_ready()
        return clock() - t

    n = 5
    alone, rotating, numpy_pages, floor_one_piece = [], [], [], []
    steps = 0
    try:
        for r in range(rounds):
            t = clock()
            np.copyto(dst, src)  # right after the last run's steps, as in benchmarks.duplex
            floor_one_piece.append(clock() - t)
            alone.append(rig.run(step, model.params, False, n))
            rotating.append(rig.run(step, model.params, True, n))
            steps += n
            numpy_pages.append(statistics.mean(numpy_pages_step(r * n + i) for i in range(n)))
    finally:
        rotation._arrived = arrived
    med = statistics.median
    piece = {k: 1e3 * v / steps for k, v in acc.items()}  # ms per rotating step (means)
    step_rot = [p["step"] for p in rig.pieces[-rounds:]]
    pieces = {
        "scatter program (in)": piece["scatter"],
        "gather program (out)": piece["gather"],
        "poll host (arrived checks incl.)": piece["poll"] - piece["scatter"],
        "  of which arrived checks": piece["arrived"],
        "execute host": piece["execute"] - piece["gather"],
        "bookkeeping (rotate_out, rotate_in)": piece["bookkeeping"],
        "step over step alone": 1e3 * (med(step_rot) - med(alone)),
    }
    added = 1e3 * (med(rotating) - med(alone))
    floor = 1e3 * 2 * rot_bytes / (memcpy_GBps * 1e9)
    rows = [{"piece": k, "ms_per_step": v} for k, v in pieces.items()]
    rows.append({"piece": "added (rotating - alone, medians)", "ms_per_step": added})
    costs = [{"same bytes, one copy each way": k, "ms": v, "added_over_it": added / v}
             for k, v in (("floor: memcpy ceiling of the run", floor),
                          ("numpy, one piece, after steps (interleaved floor)",
                           1e3 * med(floor_one_piece)),
                          ("numpy pages in the step loop",
                           1e3 * (med(numpy_pages) - med(alone))))]
    return {"model": "smollm2-135m (random, f32)", "batch": batch, "ctx": ctx,
            "pages_each_way": rot, "MB_each_way": rot_bytes / 1e6,
            "step_alone_ms": 1e3 * med(alone), "pieces": rows, "costs": costs,
            "tokens_equal": bool(np.array_equal(rig.tokens, rig.alone_tokens))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, "duplex_attribution")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args(argv)
    keep_freed_memory()  # as benchmarks.duplex does (the added time measured the same without)
    ceiling = memcpy_gbps(1 << 28 if args.quick else 1 << 30)
    result = attribution(args.quick, args.rounds, ceiling["memcpy_GBps"])
    result["ceilings"] = ceiling
    print_table(result["pieces"], title=f"fused rotation, {result['pages_each_way']} pages "
                f"({result['MB_each_way']:.1f} MB) each way, step alone "
                f"{result['step_alone_ms']:.1f} ms")
    print_table(result["costs"], title="the same bytes (goal: added <= 1.2x the floor)")
    print(f"tokens equal: {result['tokens_equal']}")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
