"""How fast the simulator runs, and where its host time goes.

Each scenario simulates ``--num-requests`` requests of a preset at one rate for each
policy and prints wall and CPU time, simulated requests per second, microseconds per
engine step, and the host time of one ``Scheduler.schedule`` call by how many requests
were waiting (near 100, 1,000 and 10,000: the scheduler's cost must not grow with the
queue); with ``--profile``, the functions that take the time (cProfile, by own time).

Scenarios (``--scenarios``, default both):

- ``knee``: contention, Qwen2.5-32B on ShareGPT on gh200-96g at 13 req/s, the rate where
  fcfs's TTFT attainment first falls to 60% or below in ``superinfer simulate --preset
  paper-qwen32b-sharegpt`` (its knee). Arrivals outpace service, so the queue grows past
  10,000 requests over a 100,000-request run and every step of RotaSched ranks.
- ``light``: Llama-3-8B on ShareGPT at 40 req/s on gh200-96g, no contention: the cost of
  the step loop itself.
- ``overload`` (not in the default list): the ``knee`` preset at 20 req/s, where the queue
  passes 10,000 requests for every policy (RotaSched serves more, so its queue grows
  slowest: about 10,000 after 50,000 requests), for the ``sched_us_q10000`` column.

Wall time on a shared machine is an upper bound (the CPU column is this process's
time); the goal is 100,000 requests under 60 s for every policy in the ``knee`` scenario.
The ``compiled`` column says whether the mypyc build of the scheduler, KV and simulator
modules ran (``superinfer_jax.mypyc_build``; ``SUPERINFER_COMPILED=0`` runs plain Python,
the baseline: ``--baseline-plain`` runs each row again that way, in a subprocess after
it, and adds ``plain_wall_s`` and ``speedup``).

    python -m benchmarks.sim speed [--quick] [--scenarios knee] [--policies rotasched]
    python -m benchmarks.sim speed --preset paper-llama8b-sharegpt --rate 40 \\
        --num-requests 100000 --policies fcfs --profile   # one custom scenario
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import superinfer_jax.mypyc_build as compiled
from benchmarks.lib.common import add_common_args, print_table, write_json

QUEUE_SIZES = (100, 1_000, 10_000)  # waiting requests at which a schedule call is timed


@dataclass(frozen=True)
class Scenario:
    name: str
    preset: str
    hardware: str
    rate: float


SCENARIOS = {s.name: s for s in (
    Scenario("knee", "paper-qwen32b-sharegpt", "gh200-96g", 13.0),
    Scenario("light", "paper-llama8b-sharegpt", "gh200-96g", 40.0),
    Scenario("overload", "paper-qwen32b-sharegpt", "gh200-96g", 20.0),
)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sim speed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, "sim_speed")
    p.add_argument("--scenarios", default="knee,light",
                   help=f"comma-separated, of {sorted(SCENARIOS)}")
    p.add_argument("--preset", help="instead of --scenarios: this preset at --rate")
    p.add_argument("--hardware", default="gh200-96g")
    p.add_argument("--dataset", help="override the preset's dataset")
    p.add_argument("--rate", type=float, help="requests per second (with --preset)")
    p.add_argument("--num-requests", type=int, default=100_000)
    p.add_argument("--policies", default="fcfs,swap,rotasched")
    p.add_argument("--profile", action="store_true", help="cProfile each run (slower)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline-plain", action="store_true",
                   help="also run each row as plain Python (SUPERINFER_COMPILED=0, in a "
                        "subprocess, one after the other) and report the speed-up")
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests = min(args.num_requests, 5000)
    if args.preset:
        if args.rate is None:
            p.error("--preset needs --rate")
        args.scenario_list = [Scenario("custom", args.preset, args.hardware, args.rate)]
    else:
        unknown = [s for s in args.scenarios.split(",") if s not in SCENARIOS]
        if unknown:
            p.error(f"--scenarios: unknown {unknown}; scenarios: {sorted(SCENARIOS)}")
        args.scenario_list = [SCENARIOS[s] for s in args.scenarios.split(",")]
    return args


def queue_columns(queue, took) -> dict[str, float | None]:
    """Median microseconds of a schedule call with about N requests waiting (N/1.25 to
    1.25 N), for N in ``QUEUE_SIZES``; None where the run never had that many."""
    out: dict[str, float | None] = {}
    for n in QUEUE_SIZES:
        near = [s for q, s in zip(queue, took, strict=True) if n / 1.25 <= q <= n * 1.25]
        out[f"sched_us_q{n}"] = 1e6 * statistics.median(near) if near else None
    return out


def run_one(scenario: Scenario, policy: str, specs, args) -> tuple[dict, str | None]:
    from dataclasses import replace

    from superinfer_jax.sim.presets import get_preset
    from superinfer_jax.sim.stats import summarize

    preset = get_preset(scenario.preset)
    if args.dataset:
        preset = replace(preset, dataset=args.dataset)
    sim = preset.simulator(scenario.hardware, policy)
    prof = cProfile.Profile() if args.profile else None
    t0, cpu0 = time.perf_counter(), time.process_time()
    if prof is not None:
        prof.enable()
    result = sim.run(specs, time_schedule=True)
    if prof is not None:
        prof.disable()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    s = summarize(result)
    queue, took = result.schedule_queue or [], result.schedule_s or []
    row = {"scenario": scenario.name, "policy": policy, "requests": len(specs),
           "wall_s": wall, "cpu_s": cpu, "req_per_s": len(specs) / wall,
           "steps": result.num_steps, "us_per_step": 1e6 * wall / max(1, result.num_steps),
           "max_queue": max(queue, default=0), **queue_columns(queue, took),
           "rotations": s["num_rotations"], "ttft_att": s["ttft_attainment"],
           "compiled": compiled.active() is not None}
    profile = None
    if prof is not None:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
        profile = out.getvalue()
    return row, profile


def plain_python_wall_s(scenario: Scenario, policy: str, num_requests: int, seed: int,
                        dataset: str | None) -> float:
    """Wall seconds of the same row with the mypyc build off, in its own process."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "plain.json")
        cmd = [sys.executable, "-m", "benchmarks.sim", "speed", "--preset", scenario.preset,
               "--hardware", scenario.hardware, "--rate", str(scenario.rate),
               "--num-requests", str(num_requests), "--policies", policy,
               "--seed", str(seed), "--out", out]
        if dataset:
            cmd += ["--dataset", dataset]
        subprocess.run(cmd, env=dict(os.environ, SUPERINFER_COMPILED="0"), check=True,
                       stdout=subprocess.DEVNULL)
        with open(out) as f:
            row = json.load(f)["rows"][0]
    assert not row["compiled"]
    return float(row["wall_s"])


def main(argv: list[str] | None = None) -> None:
    from serving.bench.sharegpt import default_tokenizer
    from superinfer_jax.sim.cli import to_specs
    from superinfer_jax.sim.presets import get_preset
    from superinfer_jax.sim.workloads import SLOClass, WorkloadSpec, build_workload

    args = parse_args(argv)
    print("scheduler and simulator modules: " + (
        f"compiled (mypyc, {compiled.active()})" if compiled.active() else
        "plain Python (no mypyc build for this source, or SUPERINFER_COMPILED=0)"))
    rows, profiles = [], {}
    for scenario in args.scenario_list:
        preset = get_preset(scenario.preset)
        work = build_workload(WorkloadSpec(
            dataset=args.dataset or preset.dataset, num_requests=args.num_requests,
            rate=scenario.rate, max_prompt=preset.max_prompt, max_total=preset.max_total,
            seed=args.seed, slo_mix=(SLOClass(1.0, preset.ttft_ms, preset.tbt_ms),)),
            load_tokenizer=default_tokenizer)
        specs = to_specs(work)
        for policy in args.policies.split(","):
            row, profile = run_one(scenario, policy, specs, args)
            if args.baseline_plain:
                row["plain_wall_s"] = plain_python_wall_s(
                    scenario, policy, args.num_requests, args.seed, args.dataset)
                row["speedup"] = row["plain_wall_s"] / row["wall_s"]
            rows.append(row)
            print_table([row])
            if profile is not None:
                profiles[f"{scenario.name}/{policy}"] = profile
                print(profile)
    print_table(rows, title="simulator speed (wall time on a shared machine is an upper "
                            "bound; sched_us_qN: median schedule() call with ~N waiting)")
    write_json(args.out, {"args": {k: v for k, v in vars(args).items()
                                   if k != "scenario_list"},
                          "scenarios": [vars(s) for s in args.scenario_list],
                          "rows": rows, "profiles": profiles})
