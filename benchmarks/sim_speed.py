"""How fast the simulator runs, and where its host time goes.

Simulates ``--num-requests`` requests of a preset at one rate for each policy and prints
wall time, simulated requests per second and microseconds per engine step; with
``--profile``, the functions that take the time (cProfile, by own time), which are the
scheduler's and the page bookkeeping's: the simulator itself adds little per step.

    python -m benchmarks.sim_speed --preset paper-llama8b-sharegpt --rate 40 \\
        --num-requests 100000 --policies fcfs [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

from benchmarks.common import add_common_args, print_table, write_json


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, "sim_speed")
    p.add_argument("--preset", default="paper-llama8b-sharegpt")
    p.add_argument("--hardware", default="gh200-96g")
    p.add_argument("--dataset", help="override the preset's dataset")
    p.add_argument("--rate", type=float, default=40.0)
    p.add_argument("--num-requests", type=int, default=100_000)
    p.add_argument("--policies", default="fcfs,swap,rotasched")
    p.add_argument("--profile", action="store_true", help="cProfile each run (slower)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests = min(args.num_requests, 5000)
    return args


def main(argv: list[str] | None = None) -> None:
    from dataclasses import replace

    from benchmarks.simulate import to_specs
    from benchmarks.workloads import SLOClass, WorkloadSpec, build_workload
    from superinfer_jax.sim.presets import get_preset
    from superinfer_jax.sim.stats import summarize

    args = parse_args(argv)
    preset = get_preset(args.preset)
    if args.dataset:
        preset = replace(preset, dataset=args.dataset)
    work = build_workload(WorkloadSpec(
        dataset=preset.dataset, num_requests=args.num_requests, rate=args.rate,
        max_prompt=preset.max_prompt, max_total=preset.max_total, seed=args.seed,
        slo_mix=(SLOClass(1.0, preset.ttft_ms, preset.tbt_ms),)))
    specs = to_specs(work)
    rows, profiles = [], {}
    for policy in args.policies.split(","):
        sim = preset.simulator(args.hardware, policy)
        prof = cProfile.Profile() if args.profile else None
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        result = sim.run(specs)
        if prof is not None:
            prof.disable()
        wall = time.perf_counter() - t0
        s = summarize(result)
        rows.append({"policy": policy, "requests": len(specs), "wall_s": wall,
                     "req_per_s": len(specs) / wall, "steps": result.num_steps,
                     "us_per_step": 1e6 * wall / max(1, result.num_steps),
                     "decode_tokens": result.num_decode_tokens,
                     "us_per_token": 1e6 * wall / max(1, result.num_decode_tokens),
                     "rotations": s["num_rotations"], "ttft_att": s["ttft_attainment"]})
        print_table([rows[-1]])
        if prof is not None:
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
            profiles[policy] = out.getvalue()
            print(profiles[policy])
    print_table(rows, title=f"simulator speed: {preset.name} on {args.hardware} at "
                            f"{args.rate:g} req/s")
    write_json(args.out, {"args": vars(args), "rows": rows, "profiles": profiles})


if __name__ == "__main__":
    main()
