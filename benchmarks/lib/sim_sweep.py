"""``benchmarks.policy_sweep``, simulated: the same workloads and seeds on this machine's
calibrated cost model, many seeds in seconds.

``policy_sweep`` runs the engine in real time: one 3-seed multi-turn run of four
policies takes about 9 minutes, and at the knee fcfs's TTFT attainment on identical
inputs moved from 0.550 to 0.669 over five such runs (the closed loop makes small timing
differences cascade), so a 1.5x ratio read from one run is +-0.2x. This benchmark plays
the same requests (``--workload trace``: the Azure trace sample, Poisson arrivals and
seeds of ``policy_sweep``; ``--workload multiturn``: the same ShareGPT conversations,
closed loop, through ``Simulator.run_conversations``) through the simulator (the same
scheduler, policies, prefix cache and page bookkeeping as the engine), priced by the
engine's latency profile of SmolLM2 on this CPU (``CalibratedCost``), with
``policy_sweep``'s pool (48 device pages, 512 host pages) and knobs. It is
deterministic, so two policies differ only by what they decide, and 20 seeds (the
default) take seconds: a tool to find what to measure on the engine, not a replacement for that
measurement (the simulator prices a step as host work, prefill, then decode, without the
engine's async overlap).

Calibration (``--host-step-ms``, ``--speed``): with the engine's profile as measured and
2.3 ms of host time a step (``policy_sweep``'s ``host_ms_step``), the simulated P50 TBT
of fcfs on the multi-turn sweep was 47.6 ms against the engine's 45.8 ms, and fcfs's
TTFT attainment at 1 conversation/s on seeds 0-2 0.615 against the engine's 0.55-0.67.

Policies are registered names or plug-ins, each optionally with RotaSched knobs after a
colon: ``rotasched:residency_share=0.25:beta_b=3`` (label = the whole string). The
default compares fcfs, the paper's rules (``late_order=lag:residency_share=1:parked_replies=
lag:beta_b=0``, RotaSched before session 25), RotaSched before session 26
(``parked_replies=lag:beta_b=0``), and RotaSched as configured.

Rows pool every seed of one policy and rate; ``vs_fcfs`` columns are against fcfs at that
rate. The verdict: multi-turn, #15's goal at the knee (the first rate where fcfs TTFT
attainment is at most 60%: TTFT attainment >= 1.5x fcfs's, TBT attainment at most 5
points lower); trace, ``policy_sweep.knee_verdict`` for each policy.

    python -m benchmarks.sim sweep [--quick] [--workload multiturn|trace] [--seeds 0-19]
        [--rates 1,1.25] [--policies fcfs,rotasched,rotasched:residency_share=0.25]
        [--latency-profile results/smollm2_cpu_latency_profile.json]
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np

from benchmarks.lib.common import add_common_args, parse_seeds, print_table, write_json

DEFAULT_PROFILE = os.path.join("results", "smollm2_cpu_latency_profile.json")
DEFAULTS = {  # per workload: rates, TTFT and TBT SLOs (session 23's engine runs)
    "multiturn": ("0.75,1,1.25,1.5", 1390.0, 86.0),
    "trace": ("0.5,1,2,3", 1096.0, 84.0),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sim sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, "sim_sweep")
    p.add_argument("--workload", default="multiturn", choices=tuple(DEFAULTS))
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--policies", default="fcfs,rotasched:late_order=lag:residency_share=1:"
                                         "parked_replies=lag:beta_b=0,"
                                         "rotasched:parked_replies=lag:beta_b=0,rotasched",
                   help="comma-separated; each a policy name or module:Class, optionally "
                        "followed by :knob=value RotaSched overrides")
    p.add_argument("--rates", help="requests/s (trace) or conversations/s (multiturn); "
                   f"default {', '.join(f'{w} {d[0]}' for w, d in DEFAULTS.items())}")
    p.add_argument("--seeds", help="e.g. 0-19 or 0,1,2 or 0-3,7 (default 0-19; --quick "
                                   "0-3); pooled per row")
    p.add_argument("--ttft-slo-ms", type=float, help="default: multiturn 1390, trace 1096 "
                   "(5x the unloaded TTFT of session 23's engine runs)")
    p.add_argument("--tbt-slo-ms", type=float, help="default: multiturn 86, trace 84")
    t = p.add_argument_group("trace (--workload trace, as policy_sweep)")
    t.add_argument("--num-requests", type=int, default=64)
    t.add_argument("--trace", default="azure_conv")
    t.add_argument("--scale", type=float, default=0.125)
    m = p.add_argument_group("multi-turn (--workload multiturn, as policy_sweep)")
    m.add_argument("--num-conversations", type=int, default=16, help="per seed")
    m.add_argument("--think-time-s", type=float, default=1.0)
    m.add_argument("--think-time-dist", default="exponential")
    m.add_argument("--min-turns", type=int, default=2)
    m.add_argument("--max-turns", type=int)
    m.add_argument("--max-message-tokens", type=int, default=32)
    m.add_argument("--sharegpt-path")
    e = p.add_argument_group("engine and cost")
    e.add_argument("--max-prompt", type=int, default=256)
    e.add_argument("--max-output", type=int, default=48)
    e.add_argument("--device-pages", type=int, default=48)
    e.add_argument("--host-pages", type=int, default=512)
    e.add_argument("--latency-profile", default=DEFAULT_PROFILE,
                   help="the engine's latency model JSON; profiled (and saved) if absent")
    e.add_argument("--host-step-ms", type=float, default=2.3,
                   help="engine host time per step the profile does not see (2.3: "
                        "policy_sweep's host_ms_step at the multi-turn knee, session 23)")
    e.add_argument("--host-row-ms", type=float, default=0.0, help="... and per request row")
    e.add_argument("--speed", type=float, default=1.0,
                   help="multiply every profiled duration (to match an engine run's P50 "
                        "TBT on a slower or shared machine)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    rates, ttft, tbt = DEFAULTS[args.workload]
    if args.quick:
        rates = "1" if args.workload == "multiturn" else "2"
    args.seeds = args.seeds or ("0-3" if args.quick else "0-19")
    args.rates = args.rates or rates
    args.ttft_slo_ms = ttft if args.ttft_slo_ms is None else args.ttft_slo_ms
    args.tbt_slo_ms = tbt if args.tbt_slo_ms is None else args.tbt_slo_ms
    for flag, value in (("--ttft-slo-ms", args.ttft_slo_ms), ("--tbt-slo-ms", args.tbt_slo_ms)):
        if not value > 0:
            parser.error(f"{flag} must be > 0, got {value}")
    try:
        parse_seeds(args.seeds)
    except ValueError:
        parser.error(f"--seeds: expected e.g. 0-19 or 0,1,2, got {args.seeds!r}")
    return args


def engine_config(args: argparse.Namespace, policy: str):
    """``policy_sweep.engine_config``'s engine (no compilation cache: nothing compiles),
    with ``policy`` and its knobs."""
    from benchmarks.policy_sweep import engine_config as sweep_engine_config
    from superinfer_jax.sim.presets import with_policy

    base = sweep_engine_config(argparse.Namespace(**vars(args), compilation_cache=None)
                               ).replace(warmup=False, show_progress=False)
    return with_policy(base, policy)


def latency_model(args: argparse.Namespace, model):
    """The saved profile, or the engine's profile of this machine (then saved)."""
    from superinfer_jax.sched.latency import LatencyModel

    if os.path.exists(args.latency_profile):
        return LatencyModel.load(args.latency_profile)
    from superinfer_jax import LLMEngine
    from superinfer_jax.runner.profiler import profile_engine

    print(f"profiling the engine on this machine -> {args.latency_profile}")
    cfg = engine_config(args, "fcfs").replace(warmup=True)
    latency = profile_engine(LLMEngine(model, cfg).runner)
    os.makedirs(os.path.dirname(args.latency_profile) or ".", exist_ok=True)
    latency.save(args.latency_profile)
    return latency


def to_conversation_specs(convs: list) -> list:
    """``Conversation`` -> ``ConversationSpec``: each turn's prompt ids are its hash ids
    (``block_tokens`` 1), so the cache finds exactly the history the engine's would."""
    from superinfer_jax.request import SLO
    from superinfer_jax.sim import ConversationSpec, RequestSpec

    out = []
    for c in convs:
        slo = SLO(ttft_ms=c.ttft_ms, tbt_ms=c.tbt_ms, priority_class=c.priority_class)
        turns = tuple(RequestSpec(c.start_s, c.prompt_len(k), c.output_len(k), slo,
                                  hash_ids=tuple(c.prompt_ids(k)), block_tokens=1)
                      for k in range(c.num_turns))
        out.append(ConversationSpec(c.start_s, turns, tuple(c.think_s)))
    return out


def trace_specs(args: argparse.Namespace, rate: float, seed: int) -> list:
    """``policy_sweep``'s trace requests for ``rate`` and ``seed`` (the same sample and
    arrivals; random prompts there, no content here: neither ever hits the cache)."""
    from benchmarks.policy_sweep import trace_arrivals, trace_samples
    from superinfer_jax.request import SLO
    from superinfer_jax.sim import RequestSpec

    sample = trace_samples(args, [seed])[seed]
    slo = SLO(ttft_ms=args.ttft_slo_ms, tbt_ms=args.tbt_slo_ms)
    return [RequestSpec(float(a), r.prompt_len, r.output_len, slo)
            for r, a in zip(sample, trace_arrivals(args, rate, seed), strict=True)]


def simulator(args: argparse.Namespace, policy: str, latency, page_bytes: int):
    from benchmarks.lib.sim_validation import scaled
    from superinfer_jax.sim import CalibratedCost, HostOverhead, Simulator

    cfg = engine_config(args, policy)
    host = HostOverhead(args.host_step_ms / 1000, args.host_row_ms / 1000)
    cost = scaled(CalibratedCost(latency, cfg, page_bytes, host), args.speed)
    return Simulator(cfg, cost, args.device_pages, args.host_pages, cost.latency)


def pooled_row(policy: str, rate: float, results: list) -> dict[str, Any]:
    """One row over every seed's requests (turns): attainment over all of them and all
    their gaps, throughput over the summed durations."""
    ttft_ok = gaps_ok = gaps = rotations = cached = prompt = out_tokens = 0
    tbts: list[float] = []
    ttfts: list[float] = []
    for res in results:
        for r in res.requests:
            times = np.asarray(r.token_times)
            ttfts.append((times[0] - r.arrival_time) * 1000)
            ttft_ok += ttfts[-1] <= r.slo.ttft_ms
            g = np.diff(times) * 1000
            gaps += len(g)
            gaps_ok += int((g <= r.slo.tbt_ms).sum())
            tbts.extend(g.tolist())
            rotations += r.num_rotations
            cached += r.num_cached_tokens
            prompt += len(r.prompt_token_ids)
            out_tokens += len(times)
    n = len(ttfts)
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else float("nan")  # noqa: E731
    return {"policy": policy, "rate": rate, "requests": n,
            "ttft_att": ttft_ok / max(1, n),
            "tbt_att": gaps_ok / gaps if gaps else float("nan"),
            "mean_ttft_ms": float(np.mean(ttfts)) if ttfts else float("nan"),
            "p99_ttft_ms": pct(ttfts, 99), "p50_tbt_ms": pct(tbts, 50),
            "p99_tbt_ms": pct(tbts, 99),
            "out_tok_s": out_tokens / max(1e-9, sum(res.duration_s for res in results)),
            "rotations": rotations, "hit_rate": cached / max(1, prompt)}


def multiturn_verdict(rows: list[dict[str, Any]], baseline: str = "fcfs") -> list[str]:
    """#15's goal, per policy, at the knee (first rate with baseline TTFT att <= 0.6)."""
    by = {(r["policy"], r["rate"]): r for r in rows}
    knees = sorted(rate for (p, rate), r in by.items()
                   if p == baseline and r["ttft_att"] <= 0.6)
    if not knees:
        return [f"no rate brought {baseline} TTFT attainment to 60% or less: add rates"]
    rate, out = knees[0], []
    base = by[(baseline, rate)]
    for (p, r), row in by.items():
        if r != rate or p == baseline:
            continue
        x = row["ttft_att"] / max(base["ttft_att"], 1e-9)
        pts = 100 * (row["tbt_att"] - base["tbt_att"])
        met = x >= 1.5 and pts >= -5
        out.append(f"knee {rate:g} conv/s ({baseline} TTFT att {base['ttft_att']:.3f}): {p} "
                   f"{x:.2f}x (goal >= 1.5), TBT {pts:+.1f} points (goal >= -5): "
                   f"{'met' if met else 'NOT met'}")
    return out


def verdict(args: argparse.Namespace, rows: list[dict[str, Any]]) -> list[str]:
    if args.workload == "multiturn":
        return multiturn_verdict(rows)
    from benchmarks.policy_sweep import knee_verdict

    return [f"{p}: " + knee_verdict(rows, policy=p)["text"]
            for p in dict.fromkeys(r["policy"] for r in rows) if p != "fcfs"]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from superinfer_jax.sim.cost_model import MODELS

    policies = args.policies.split(",")
    for p in policies:
        engine_config(args, p)  # bad names and knobs fail before anything runs
    model = None  # loaded for its tokenizer (multiturn) or to profile this machine
    if args.workload == "multiturn" or not os.path.exists(args.latency_profile):
        from models import load_model

        model = load_model(args.model)
    latency = latency_model(args, model)
    page_bytes = MODELS[args.model].page_bytes(16)
    if args.workload == "multiturn":
        from superinfer_jax.sim.sharegpt import load_conversations

        records, _ = load_conversations(args.sharegpt_path)
    rows, t0 = [], time.perf_counter()
    for rate in [float(r) for r in args.rates.split(",")]:
        results: dict[str, list] = {p: [] for p in policies}
        for seed in parse_seeds(args.seeds):
            if args.workload == "multiturn":
                assert model is not None
                specs = conversation_specs(args, records, model.tokenizer, rate, seed)
            else:
                specs = trace_specs(args, rate, seed)
            for p in policies:
                sim = simulator(args, p, latency, page_bytes)
                results[p].append(sim.run_conversations(specs)
                                  if args.workload == "multiturn" else sim.run(specs))
        base = pooled_row("fcfs", rate, results["fcfs"]) if "fcfs" in results else None
        for p in policies:
            row = pooled_row(p, rate, results[p])
            if base is not None:
                row["ttft_vs_fcfs"] = row["ttft_att"] / max(base["ttft_att"], 1e-9)
                row["tbt_pts_vs_fcfs"] = 100 * (row["tbt_att"] - base["tbt_att"])
                row["p99_tbt_vs_fcfs"] = row["p99_tbt_ms"] / max(base["p99_tbt_ms"], 1e-9)
            rows.append(row)
    print_table(rows, title=f"simulated {args.workload} sweep (seeds {args.seeds} pooled, "
                            f"SLO TTFT {args.ttft_slo_ms:g} ms / TBT {args.tbt_slo_ms:g} ms, "
                            f"{time.perf_counter() - t0:.0f} s)")
    lines = verdict(args, rows)
    for line in lines:
        print(line)
    write_json(args.out, {"args": vars(args), "rows": rows, "verdict": lines})


def conversation_specs(args: argparse.Namespace, records: list, tokenizer, rate: float,
                       seed: int) -> list:
    """``policy_sweep``'s conversations for ``rate`` and ``seed``, as simulator specs."""
    from benchmarks.policy_sweep import multiturn_spec
    from superinfer_jax.sim.conversations import build_conversations

    spec = multiturn_spec(args, rate, seed, args.ttft_slo_ms, args.tbt_slo_ms)
    return to_conversation_specs(build_conversations(records, tokenizer, spec))
