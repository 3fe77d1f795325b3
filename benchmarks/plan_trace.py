"""Fingerprints of seeded simulator runs, for showing that a scheduler refactor changes
nothing: one hash of every request's outputs (token times, rotations, preemptions,
recomputed tokens, the run's counters and summary) and one hash per step of the plan
(prefill and decode rows, preempted, rotated out and in, the page moves each way, and
the eager shadows planned for the step).

Cases: the paper preset (Qwen2.5-32B on ShareGPT, GH200 roofline, a smaller HBM share so
a 20 s run is contended) and a CPU-calibrated setup (SmolLM2 on a fixed CPU latency
profile with host overhead per step, row and page, as ``policy_sweep`` runs it: 48
device pages, 512 host pages), each for fcfs, swap, rotasched (and rotasched in slack
mode on the CPU setup). Every run must rotate or preempt, else it proves little.
Two cases run with prefix caching, for the KV manager's cache paths (device eviction,
host shadows becoming cache-only pages, spills, host-tier hits): ``mooncake`` (the Llama-3-8B
Mooncake conversation preset on GH200 144G, its first 400 requests at 2.5 req/s) and
``cpu-prefix`` (the CPU setup on requests sharing a few prompt prefixes, the host cache
capped at 96 pages so it evicts), each also with the host cache evicting ``fifo``.

    python -m benchmarks.plan_trace --out /tmp/sched_before
    python -m benchmarks.plan_trace --out /tmp/sched_after \\
        --compare /tmp/sched_before

``--rotasched SPEC`` runs the rotasched cases as a policy string (``split_policy``), so a
change of defaults is checked against a preset that keeps the old ones:
``--rotasched rotasched:preset=attainment --compare`` a trace of the old defaults.

With the mypyc build of the scheduler in use (``superinfer_jax.mypyc_build``), methods
replaced on instances are not called by compiled code, so the step trace cannot be
recorded: run with ``SUPERINFER_COMPILED=0``, or pass ``--outputs-only`` (no step trace;
``--compare`` then checks the outputs hash and step count, which is how a compiled build
is checked against plain Python).

Shadows are recorded where they are planned (``TwoTierKVManager.take_spills`` and
``plan_shadows``), between one ``schedule`` call and the next, so the trace is the same
whether the simulator or the scheduler plans them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import replace
from typing import Any

CASES = ("paper", "cpu", "mooncake", "cpu-prefix")
PREFIX_CASES = ("mooncake", "cpu-prefix")  # prefix caching on; also run ``rotasched-fifo``
POLICY_RUNS = ("fcfs", "swap", "rotasched")


def _h(obj: Any) -> str:
    return hashlib.sha256(repr(obj).encode()).hexdigest()


def _moves(moves) -> tuple:
    return tuple((m.req_id, tuple(m.device_pages), tuple(m.host_pages)) for m in moves)


class Recorder:
    """Wraps one ``_Run``'s scheduler and page manager; records a tuple per step."""

    def __init__(self) -> None:
        self.steps: list[tuple] = []
        self.current: tuple | None = None
        self.shadows: list = []
        self.plan_shadows_mismatch = 0

    def attach(self, run) -> None:
        kv, sched = run.kv, run.sched
        plan_shadows, take_spills, schedule = kv.plan_shadows, kv.take_spills, sched.schedule

        def recorded_plan_shadows(num_computed, max_pages):
            out = plan_shadows(num_computed, max_pages)
            self.shadows.extend(out)
            return out

        def recorded_take_spills():  # a step's spills go before its shadows
            out = take_spills()
            if out:
                self.shadows.append(out)
            return out

        def recorded_schedule(now=None):
            self.flush()
            plan = schedule(now)
            self.current = (repr(now), tuple(plan.prefill), tuple(plan.decode),
                            tuple(plan.preempted), tuple(plan.rotate_out),
                            tuple(plan.rotate_in), _moves(plan.moves_out),
                            _moves(plan.moves_in))
            self.plan = plan
            return plan

        kv.plan_shadows = recorded_plan_shadows
        kv.take_spills = recorded_take_spills
        sched.schedule = recorded_schedule

    def flush(self) -> None:
        if self.current is None:
            return
        shadows = _moves(self.shadows)
        in_plan = getattr(self.plan, "shadows", None)
        if in_plan is not None and _moves(in_plan) != shadows:
            self.plan_shadows_mismatch += 1
        self.steps.append(self.current + (shadows,))
        self.current, self.shadows = None, []


def _cpu_preset():
    from superinfer_jax.config import EngineConfig
    from superinfer_jax.sched.latency import LatencyModel
    from superinfer_jax.sim.cost import HostOverhead
    from superinfer_jax.sim.cost_model import MODELS
    from superinfer_jax.sim.presets import THIS_MACHINE, Calibration, SimPreset

    # A 2-core CPU running SmolLM2-135M (float32 KV), fixed here so the run is seeded:
    # prefill p0 + p1 * tokens + p2 * tokens * context, decode d0 + d1 * rows + d2 * ctx.
    latency = LatencyModel(prefill=[0.020, 6e-4, 2e-7], decode=[0.030, 2e-3, 2e-6],
                           transfer=[1e-4, 1e-9], model_name="smollm2-135m", machine="cpu")
    page_bytes = MODELS["smollm2-135m"].page_bytes(16)
    calib = Calibration(latency, page_bytes, num_device_pages=48, num_host_pages=512,
                        host=HostOverhead(per_step_s=2e-3, per_row_s=3e-4, per_page_s=5e-5))
    engine = EngineConfig.build(max_model_len=320, max_num_seqs=16, max_num_batched_tokens=256,
                                max_prefill_chunk=256, warmup=False, show_progress=False)
    return SimPreset("cpu-calibrated", "SmolLM2 on a fixed CPU profile", "smollm2-135m",
                     "random", (3.0,), hardware=(THIS_MACHINE,), ttft_ms=1000.0,
                     tbt_ms=150.0, max_prompt=256, max_total=304, engine=engine,
                     calibration=calib)


def _shared_prefix_specs(n: int = 300, seed: int = 0) -> list:
    """``n`` requests at 3 req/s whose prompts start with one of 6 shared prefixes (2-8
    pages) and go on with pages of their own: page-sized hash blocks, so pages are shared
    exactly where the prefixes are."""
    import numpy as np

    from superinfer_jax.request import SLO
    from superinfer_jax.sim import RequestSpec

    rng = np.random.default_rng(seed)
    prefixes = [tuple(range(100 * k, 100 * k + int(rng.integers(2, 9)))) for k in range(6)]
    slos = (SLO(1000.0, 150.0, "critical"), SLO(1000.0, 150.0))
    out, t, fresh = [], 0.0, 10_000
    for _ in range(n):
        t += float(rng.exponential(1 / 3.0))
        ids = prefixes[int(rng.integers(len(prefixes)))]
        own = int(rng.integers(1, 6))
        ids += tuple(range(fresh, fresh + own))
        fresh += own
        prompt = min(256, 16 * len(ids) - int(rng.integers(0, 16)))
        out.append(RequestSpec(t, prompt, int(rng.integers(8, 48)),
                               slos[int(rng.random() < 0.8)], hash_ids=ids, block_tokens=16))
    return out


def _workload(case: str):
    from serving.bench.sharegpt import default_tokenizer
    from superinfer_jax.sim.cli import to_specs
    from superinfer_jax.sim.mooncake import BlockTrace, load_block_trace
    from superinfer_jax.sim.workloads import SLOClass, WorkloadSpec, build_workload

    if case == "mooncake":
        return load_block_trace(BlockTrace(rate=2.5, num_requests=400,
                                           slo_mix=(SLOClass(1.0, 5000.0, 100.0),)))[0]
    if case == "cpu-prefix":
        return _shared_prefix_specs()
    if case == "paper":
        spec = WorkloadSpec(dataset="sharegpt", rate=15.0, num_requests=1, duration_s=20.0,
                            max_prompt=4095, max_total=8192,
                            slo_mix=(SLOClass(1.0, 5000.0, 100.0),), seed=0)
    else:
        spec = WorkloadSpec(dataset="random", rate=3.0, num_requests=300,
                            random_input_len=110, random_output_len=40,
                            random_range_ratio=0.9, max_prompt=256, max_total=304,
                            slo_mix=(SLOClass(0.2, 1000.0, 150.0, "critical"),
                                     SLOClass(0.8, 1000.0, 150.0)), seed=0)
    return to_specs(build_workload(spec, load_tokenizer=default_tokenizer))


def _simulator(case: str, policy: str, rotasched: str = "rotasched"):
    """The case's simulator; ``rotasched``: the policy string the rotasched runs use."""
    from superinfer_jax.sim.presets import THIS_MACHINE, get_preset

    if case == "paper":
        preset = replace(get_preset("paper-qwen32b-sharegpt"), memory_fraction=0.72)
        return preset.simulator("gh200-96g", _spec(policy, rotasched))
    if case in PREFIX_CASES:
        preset = get_preset("paper-llama8b-mooncake-conv") if case == "mooncake" \
            else _cpu_preset()
        flat: dict[str, Any] = {"enable_prefix_caching": True}
        if case == "cpu-prefix":
            flat["host_cache_max_pages"] = 96
        if policy == "rotasched-fifo":
            flat["host_cache_eviction"] = "fifo"
            policy = "rotasched"
        preset = replace(preset, engine=preset.engine.replace(**flat))
        return preset.simulator("gh200-144g" if case == "mooncake" else THIS_MACHINE,
                                _spec(policy, rotasched))
    if policy == "rotasched-slack":
        return _cpu_preset().simulator(THIS_MACHINE, f"{rotasched}:mode=slack")
    return _cpu_preset().simulator(THIS_MACHINE, _spec(policy, rotasched))


def _spec(policy: str, rotasched: str) -> str:
    return rotasched if policy == "rotasched" else policy


def _outputs(result) -> tuple:
    from superinfer_jax.sim.stats import summarize

    reqs = tuple((r.req_id, repr(r.arrival_time), tuple(map(repr, r.token_times)),
                  r.num_rotations, r.num_preemptions, r.num_recomputed_tokens,
                  int(r.status), r.num_computed_tokens) for r in result.requests)
    counters = (result.num_steps, result.num_prefill_tokens, result.num_decode_tokens,
                result.pages_out, result.pages_in, result.shadow_pages,
                tuple(map(repr, result.link_busy_s)), result.num_device_pages,
                result.num_host_pages, repr(result.duration_s))
    summary = {k: repr(v) for k, v in summarize(result).items() if k != "sim_wall_s"}
    return reqs, counters, tuple(sorted(summary.items()))


def run_case(case: str, policy: str, specs, trace: bool = True,
             rotasched: str = "rotasched") -> dict[str, Any]:
    import superinfer_jax.mypyc_build as compiled
    from superinfer_jax.sim import simulator as sim_mod

    if trace and compiled.active():
        raise SystemExit("the scheduler runs compiled (superinfer_jax.mypyc_build): its steps "
                         "cannot be traced; set SUPERINFER_COMPILED=0 or pass --outputs-only")
    rec = Recorder()
    original = sim_mod._Run.__init__

    def init(self, *a, **kw):
        original(self, *a, **kw)
        rec.attach(self)

    if trace:
        sim_mod._Run.__init__ = init
    try:
        t0 = time.perf_counter()
        result = _simulator(case, policy, rotasched).run(specs)
        wall = time.perf_counter() - t0
    finally:
        sim_mod._Run.__init__ = original
    rec.flush()
    step_hashes = [_h(s) for s in rec.steps]
    reqs = result.requests
    return {
        "case": case, "policy": policy, "requests": len(reqs), "wall_s": round(wall, 2),
        "steps": len(rec.steps), "model_steps": result.num_steps,
        "compiled": compiled.active() is not None,
        "rotations": sum(r.num_rotations for r in reqs),
        "preemptions": sum(r.num_preemptions for r in reqs),
        "shadow_pages": result.shadow_pages,
        "outputs_hash": _h(_outputs(result)), "trace_hash": _h(step_hashes),
        "plan_shadows_mismatch": rec.plan_shadows_mismatch, "step_hashes": step_hashes,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for summary.json and traces")
    p.add_argument("--compare", help="a directory written before: every hash must match")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--outputs-only", action="store_true",
                   help="no step trace (works with the compiled scheduler); --compare "
                        "checks outputs and step counts only")
    p.add_argument("--rotasched", default="rotasched",
                   help="policy string of the rotasched runs (rotasched:preset=attainment: "
                        "the defaults before the bounded preset)")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    runs = []
    for case in args.cases.split(","):
        specs = _workload(case)
        policies = POLICY_RUNS + (("rotasched-slack",) if case == "cpu" else
                                  ("rotasched-fifo",) if case in PREFIX_CASES else ())
        for policy in policies:
            r = run_case(case, policy, specs, trace=not args.outputs_only,
                         rotasched=args.rotasched)
            with open(os.path.join(args.out, f"{case}-{policy}.steps"), "w") as f:
                f.writelines(f"{i} {h}\n" for i, h in enumerate(r.pop("step_hashes")))
            runs.append(r)
            print(json.dumps(r), flush=True)
            if r["rotations"] + r["preemptions"] == 0:
                print(f"WARNING: {case}/{policy} neither rotated nor preempted", flush=True)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(runs, f, indent=1)
    if not args.compare:
        return 0
    with open(os.path.join(args.compare, "summary.json")) as f:
        before = {(r["case"], r["policy"]): r for r in json.load(f)}
    bad = 0
    for r in runs:
        b = before[(r["case"], r["policy"])]
        keys = ("outputs_hash", "model_steps") if args.outputs_only else (
            "outputs_hash", "trace_hash", "steps")
        same = all(r[k] == b[k] for k in keys)
        name = f"{r['case']}-{r['policy']}.steps"
        first = None
        if not args.outputs_only:
            with open(os.path.join(args.compare, name)) as f1, \
                    open(os.path.join(args.out, name)) as f2:
                first = next((i for i, (x, y) in enumerate(zip(f1, f2, strict=False))
                              if x != y), None)
        ok = same and first is None and not r["plan_shadows_mismatch"]
        bad += not ok
        print(f"{'SAME' if ok else 'DIFFERENT'} {r['case']}/{r['policy']}: outputs "
              f"{r['outputs_hash'][:16]} vs {b['outputs_hash'][:16]}, trace "
              f"{r['trace_hash'][:16]} vs {b['trace_hash'][:16]}, {r['model_steps']} model "
              f"steps, {r['steps']} traced" + (" (compiled)" if r["compiled"] else "")
              + ("" if first is None else f", first differing step {first}")
              + (f", plan.shadows differs in {r['plan_shadows_mismatch']} steps"
                 if r["plan_shadows_mismatch"] else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
