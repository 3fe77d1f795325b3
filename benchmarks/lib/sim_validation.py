"""The simulator against the real engine, on this machine, per policy.

The same workload runs twice: through the engine (SmolLM2 on this CPU, device pool
capped so requests rotate or are recomputed; ``serving.bench.replay`` in real time) and
through the simulator calibrated on that same engine (``CalibratedCost``: the engine's
``profile_engine`` latency model, priced at the padded bucket shapes it compiles, plus a
per-step and per-row host overhead fitted on a separate calibration run whose every step
is recorded). The simulator gets the same config, page counts, requests and SLOs.
Reported per policy and rate: mean TTFT, P99 TBT (inter-token latency), TTFT and TBT
attainment, engine against simulator, and the relative error; twice: ``sim`` with the
cost model calibrated before the runs (a prediction; scaled by the CPU's speed measured
with two small calls just before each run), ``refit`` with the step costs
re-fitted on the validated run's own recorded steps (one speed factor on the profile,
plus the host terms). On a shared CPU the machine's speed drifts between calibration and
run; ``refit`` removes that drift and so isolates the simulator's scheduling dynamics
(who runs when, rotations, recomputation) from the cost model's error.

    python -m benchmarks.sim validate [--quick] [--out results/sim_validation.json]

The engine runs its synchronous loop (``async_scheduling=False``): the simulator prices a
step as host work, then the prefill call, then the decode call, one after the other, and
each recorded step must pair one plan with its own measured time to refit the costs.

SLOs are multiples of this run's unloaded latencies (as ``benchmarks.policy_sweep``), so
they mean the same on a fast or a slow (or shared) CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from benchmarks.lib.common import add_common_args, print_table, write_json
from benchmarks.policy_sweep import DEFAULT_CACHE, unloaded_latency
from superinfer_jax.sim.workloads import SLOClass, WorkloadSpec, build_workload

METRICS = (("mean_ttft_ms", "mean TTFT"), ("p99_itl_ms", "P99 TBT"),
           ("ttft_attainment", "TTFT att"), ("tbt_attainment", "TBT att"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sim validate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, "sim_validation")
    p.add_argument("--policies", default="fcfs,swap,rotasched")
    p.add_argument("--rates", default="1,2", help="requests per second")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--trace", default="azure_conv")
    p.add_argument("--scale", type=float, default=0.125, help="trace length scale")
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--max-output", type=int, default=48)
    p.add_argument("--device-pages", type=int, default=48, help="device pool cap")
    p.add_argument("--host-pages", type=int, default=512)
    p.add_argument("--ttft-mult", type=float, default=5.0)
    p.add_argument("--tbt-mult", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compilation-cache", default=DEFAULT_CACHE)
    args = p.parse_args(argv)
    if args.quick:
        args.rates, args.num_requests = "2", 16
    return args


def engine_config(args: argparse.Namespace):
    from superinfer_jax import EngineConfig

    return EngineConfig.build(
        max_model_len=args.max_prompt + args.max_output + 16, max_num_seqs=16,
        max_num_batched_tokens=256, max_prefill_chunk=256, num_device_pages=args.device_pages,
        num_host_pages=args.host_pages, compilation_cache_dir=args.compilation_cache or None,
        show_progress=False, async_scheduling=False)


def workload(args: argparse.Namespace, rate: float, seed: int, n: int, ttft_ms: float,
             tbt_ms: float):
    spec = WorkloadSpec(dataset=args.trace, num_requests=n, rate=rate, seed=seed,
                        length_scale=args.scale, max_prompt=args.max_prompt,
                        max_total=args.max_prompt + args.max_output,
                        slo_mix=(SLOClass(1.0, ttft_ms, tbt_ms),))
    return build_workload(spec)


# -- calibration ---------------------------------------------------------------------------


class StepRecorder:
    """Records every non-empty engine step: the shapes of its two calls (taken when the
    plan is made, before tokens advance) and its measured duration."""

    def __init__(self, engine):
        self.engine, self.steps = engine, []
        self._schedule = engine.scheduler.schedule
        self._step = engine.step
        engine.scheduler.schedule = self.schedule
        engine.step = self.step
        self._shapes = None

    def schedule(self, now=None, *args):
        from superinfer_jax.sim import CallShape

        plan = self._schedule(now, *args)
        reqs = self.engine.requests
        pre = [(n, reqs[r].num_computed_tokens) for r, n in plan.prefill]
        dec = [(1, reqs[r].num_computed_tokens) for r in plan.decode]
        self._shapes = (CallShape.of_rows(pre) if pre else None,
                        CallShape.of_rows(dec) if dec else None, len(pre) + len(dec))
        return plan

    def step(self):
        self._shapes = None
        before = self._pages()
        out = self._step()
        if self._shapes is not None and self._shapes[2]:
            self.steps.append((*self._shapes, self._pages() - before,
                               self.engine.last_stats.step_time_s))
        return out

    def _pages(self) -> int:
        duplex = self.engine.duplex
        return 0 if duplex is None else duplex.stats.pages_out + duplex.stats.pages_in

    def detach(self) -> None:
        del self.engine.scheduler.schedule
        del self.engine.step


def fit_cost(latency, config, page_bytes: int, steps, scale: bool = False):
    """A ``CalibratedCost`` whose host overhead (per step, per row, per page copied) is
    what the profile misses: measured step time minus the profile's price of the step's
    calls, fitted non-negative. ``scale``: also fit one factor on the profile's price
    (the CPU's speed drifts on a shared machine between profiling and a later run)."""
    from superinfer_jax.sched.latency import LatencyModel, fit_nonnegative
    from superinfer_jax.sim import CalibratedCost, HostOverhead

    bare = CalibratedCost(latency, config, page_bytes)
    feats, measured = [], []
    for pre, dec, rows, pages, took in steps:
        calls = (bare.prefill_call_s(pre) if pre else 0.0) + \
            (bare.decode_call_s(dec) if dec else 0.0)
        feats.append((calls, 1.0, rows, pages))
        measured.append(took)
    x, y = np.asarray(feats, np.float64), np.asarray(measured)
    if scale:
        alpha, a, b, c = fit_nonnegative(x, y)
    else:
        alpha, (a, b, c) = 1.0, fit_nonnegative(x[:, 1:], y - x[:, 0])
    scaled = LatencyModel([alpha * v for v in latency.prefill],
                          [alpha * v for v in latency.decode], list(latency.transfer),
                          latency.model_name, latency.machine)
    return CalibratedCost(scaled, config, page_bytes, HostOverhead(float(a), float(b), float(c)))


def speed_factor(engine, latency) -> float:
    """How much slower (> 1) or faster this CPU runs now than when ``latency`` was
    profiled: two small compiled calls timed now against the profile's prediction. On a
    shared machine the speed drifts by 2x within minutes; the ``sim`` columns scale the
    calibrated model by this factor, measured just before each engine run."""
    from superinfer_jax.runner.profiler import _time_step

    runner = engine.runner  # owns the compiled buckets
    decode = _time_step(runner, 1, 1, 1, 64, repeats=3) / latency.decode_s(1, 64)
    cols = engine.config.prefill_chunk_buckets[0]
    prefill = _time_step(runner, 1, cols, cols, cols, repeats=3) / latency.prefill_s(cols, 0)
    return float(np.sqrt(decode * prefill))


def scaled(cost, factor: float):
    """``cost`` with every duration (calls and host terms) multiplied by ``factor``."""
    from dataclasses import replace

    from superinfer_jax.sched.latency import LatencyModel
    from superinfer_jax.sim import HostOverhead

    lm, h = cost.latency, cost.host
    latency = LatencyModel([factor * v for v in lm.prefill], [factor * v for v in lm.decode],
                           list(lm.transfer), lm.model_name, lm.machine)
    host = HostOverhead(factor * h.per_step_s, factor * h.per_row_s, factor * h.per_page_s)
    return replace(cost, latency=latency, host=host)


def calibrate(engine, args: argparse.Namespace, vocab: int):
    """This machine's cost model: the engine's profile, then the host overhead fitted on
    a calibration replay (its own seed, so the validation workload is not fitted)."""
    from serving.bench.replay import replay
    from superinfer_jax.runner.profiler import profile_engine

    latency = profile_engine(engine)
    recorder = StepRecorder(engine)
    calib = workload(args, 4.0, args.seed + 1000, 24, 1e5, 1e5)
    replay(engine, timed_requests(calib, vocab, args.seed + 1000))
    recorder.detach()
    return fit_cost(latency, engine.config, engine.layout.page_bytes, recorder.steps), \
        recorder.steps


# -- the two runs --------------------------------------------------------------------------


def timed_requests(work, vocab: int, seed: int):
    from serving.bench.replay import TimedRequest

    rng = np.random.default_rng(seed)
    return [TimedRequest(r.arrival_s, rng.integers(10, vocab - 10, r.prompt_len).tolist(),
                         r.output_len, r.ttft_ms, r.tbt_ms, r.priority_class) for r in work]


def run_engine(engine, work, vocab: int, seed: int) -> tuple[dict[str, Any], list]:
    """The engine's summary, and its recorded steps (for the re-fitted simulator)."""
    from serving.bench.replay import replay
    from superinfer_jax.sim.metrics import summarize

    recorder = StepRecorder(engine)
    try:
        with tqdm(total=len(work), desc=f"engine {engine.config.engine.policy}",
                  leave=False) as bar:
            timelines, duration = replay(engine, timed_requests(work, vocab, seed), bar)
    finally:
        recorder.detach()
    return summarize(timelines, duration), recorder.steps


def run_sim(engine, cost, work) -> dict[str, Any]:
    from superinfer_jax.sim import Simulator
    from superinfer_jax.sim.cli import to_specs
    from superinfer_jax.sim.stats import summarize

    sim = Simulator(engine.config, cost, engine.num_device_pages, engine.num_host_pages,
                    engine.latency)
    return summarize(sim.run(to_specs(work)))


def compare(policy: str, rate: float, eng: dict, sim: dict, refit: dict) -> dict[str, Any]:
    row: dict[str, Any] = {"policy": policy, "rate": rate}
    for key, name in METRICS:
        e = eng[key]
        row[f"{name} eng"] = e
        for tag, s in (("sim", sim[key]), ("refit", refit[key])):
            row[f"{name} {tag}"] = s
            row[f"{name} {tag} err%"] = 100 * (s - e) / e if e else float("nan")
    row["rot e/s/r"] = f"{eng['num_rotations']}/{sim['num_rotations']}/{refit['num_rotations']}"
    row["recomp e/s/r"] = (f"{eng['recomputed_tokens']}/{sim['recomputed_tokens']}/"
                           f"{refit['recomputed_tokens']}")
    return row


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from models import load_model
    from superinfer_jax import LLMEngine

    model = load_model("smollm2-135m")
    vocab = model.vocab_size
    base = engine_config(args)
    policies = [p.strip() for p in args.policies.split(",")]
    engines = {p: LLMEngine(model, base.replace(policy=p)) for p in policies}
    first = next(iter(engines.values()))
    t0 = time.perf_counter()
    # Calibrate where pages move most (rotasched rotates under load), so the per-page
    # host cost is seen; the fitted model is then the same for every policy.
    cost, calib_steps = calibrate(engines.get("rotasched", first), args, vocab)
    h = cost.host
    print(f"calibrated in {time.perf_counter() - t0:.0f} s: {cost.latency}; host overhead "
          f"{1000 * h.per_step_s:.2f} ms/step + {1000 * h.per_row_s:.3f} ms/row + "
          f"{1000 * h.per_page_s:.3f} ms/page (fitted on {len(calib_steps)} steps)")
    for e in engines.values():
        e.set_latency_model(cost.latency)  # rotasched's slack mode reads the same model
    median_prompt = int(np.median([r.prompt_len for r in workload(args, 1.0, args.seed,
                                                                  args.num_requests, 1, 1)]))
    ttft0, step0 = unloaded_latency(first, median_prompt, vocab)
    ttft_ms, tbt_ms = 1000 * args.ttft_mult * ttft0, 1000 * args.tbt_mult * step0
    print(f"SLOs: TTFT {ttft_ms:.0f} ms, TBT {tbt_ms:.0f} ms")
    rows, raw = [], []
    for rate in [float(r) for r in args.rates.split(",")]:
        work = workload(args, rate, args.seed, args.num_requests, ttft_ms, tbt_ms)
        for policy, engine in engines.items():
            factor = speed_factor(engine, cost.latency)
            eng, steps = run_engine(engine, work, vocab, args.seed + 2)
            sim = run_sim(engine, scaled(cost, factor), work)
            refit_cost = fit_cost(cost.latency, engine.config, engine.layout.page_bytes, steps,
                                  scale=True)
            refit = run_sim(engine, refit_cost, work)
            rows.append(compare(policy, rate, eng, sim, refit))
            raw.append({"policy": policy, "rate": rate, "engine": eng, "sim": sim,
                        "speed_factor": factor, "refit": refit,
                        "refit_cost": _cost_json(refit_cost)})
            print_table([rows[-1]])
    print_table(rows, title="engine vs simulator (sim: calibrated before the runs; refit: "
                            "step costs re-fitted on this run's steps; err% = (sim - "
                            "engine) / engine)")
    write_json(args.out, {"args": vars(args), "ttft_slo_ms": ttft_ms, "tbt_slo_ms": tbt_ms,
                          "cost": _cost_json(cost), "rows": rows, "runs": raw,
                          "calibration_steps": [_step_json(s) for s in calib_steps]})


def _cost_json(cost) -> dict[str, Any]:
    # ``asdict``, not ``__dict__``: with the mypyc build (``superinfer_jax.mypyc_build``)
    # these are native classes, which have no ``__dict__``
    return {"latency": dataclasses.asdict(cost.latency), "host": dataclasses.asdict(cost.host)}


def _step_json(step) -> dict[str, Any]:
    pre, dec, rows, pages, measured = step
    return {"prefill": None if pre is None else dataclasses.asdict(pre),
            "decode": None if dec is None else dataclasses.asdict(dec), "rows": rows,
            "pages": pages,
            "measured_s": measured}
