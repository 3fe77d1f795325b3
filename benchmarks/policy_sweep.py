"""All policies on the same engine, model and requests, across request rates.

SmolLM2 on this CPU with a device pool capped so memory contention is real. Prompt and
output lengths come from the Azure 2023 conversation trace, scaled down (x ``--scale``,
clipped) to fit the machine; arrivals are Poisson at each rate. SLOs are multiples of the
unloaded latencies measured at the start of the same run: TTFT SLO = ``--ttft-mult`` x the
unloaded TTFT of a median-length prompt, TBT SLO = ``--tbt-mult`` x the unloaded
single-request decode step (each the median of 7 runs after one left out), or fixed by
``--ttft-slo-ms`` / ``--tbt-slo-ms`` to compare separate runs at equal SLOs.

Each row also says which share of the TBT misses overlap a rotation (``tbt_miss_rot``;
the rest are slow steps: on this CPU a step with any prefill chunk misses the TBT SLO for
every decoder in it, while decode-only steps meet it).

Every rate runs once per seed in ``--seeds`` (a different sample of the trace and
different arrival times) and each row pools the timelines of all seeds: attainment is
over all their requests and gaps, throughput over the summed durations. One 64-request
run moves TBT attainment by several points from run to run, so one draw does not decide
the goal. The table ends with the verdict (``knee_verdict``): at the knee, the first rate
where ``fcfs`` TTFT attainment is at most 60%, attainment, throughput and P99 TBT against
fcfs (P99 TTFT beside them, reported and not judged); at the rates where fcfs meets its
TTFT SLO, mean and P99 TTFT against fcfs.

Default rates 0.5, 1, 2, 3 (idle, 3 seeds, SLOs from an unloaded TTFT of 151-156 ms):
0.5 is the light-load check (fcfs TTFT attainment 1.000); at 1 fcfs sits on the edge of
meeting its SLO (0.995 in one run, 0.990 in another, where the verdict's >= 0.99 rule
leaves it out); 2 is the knee (fcfs 0.42) and 3 is past it. Rates 4 and 5 only added
deeper overload. The defaults take about 35 minutes on 2 cores, most of it rate 0.5.

``--workload multiturn``: instead of the trace, ShareGPT conversations replayed turn by
turn in closed loop (``serving.bench.multiturn``): ``--rates`` are conversations/s (Poisson
starts), ``--num-conversations`` per seed (each seed samples other conversations), turn
k+1 leaves after turn k's answer plus ``--think-time-s``; turn k's prompt is the whole
history as token ids, an exact extension of turn k-1's, cut to ``--max-prompt`` tokens
(a conversation ends at its first turn over it) with every message cut to
``--max-message-tokens``. Prefix caching is on for every policy, each run under a fresh
cache salt (a cold cache); rows add conversations, turns and the prompt tokens served
from the cache (``cached_tok``, ``hit_rate``).

    python -m benchmarks.policy_sweep [--quick] [--seeds 0,1,2] [--out results/policy_sweep.json]
    python -m benchmarks.policy_sweep --quick --policies fcfs,examples.edf_policy:EDFPolicy
    python -m benchmarks.policy_sweep --workload multiturn --rates 0.5,1,2 \
        --num-conversations 16 --think-time-s 1 --out results/policy_sweep_multiturn.json

``--speculative none,fixed:1,fixed:3,fixed:5,slo:5`` runs every policy once per
speculation setting (n-gram proposals; ``benchmarks.lib.spec_sweep``), and
``--max-num-seqs 8,32`` once per batch cap: every engine replays the same requests, and
the verdict becomes the per-setting summary (attainment against no speculation, output
throughput against the best fixed k, seed by seed too). Rows add ``speculative``,
``max_num_seqs`` and ``acceptance`` (accepted / proposed tokens). The engines of one
``max_num_seqs`` are built at a time and dropped before the next (memory holds one group).

    python -m benchmarks.policy_sweep --workload multiturn --policies rotasched \
        --speculative none,fixed:1,fixed:3,fixed:5,slo:5 --max-num-seqs 8,32
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import numpy as np
from tqdm.auto import tqdm

from benchmarks.lib import spec_sweep
from benchmarks.lib.common import add_common_args, parse_seeds, print_table, write_json
from serving.bench.replay import build_requests, replay
from superinfer_jax.sim.conversations import HISTORIES, THINK_DISTS, MultiTurnSpec
from superinfer_jax.sim.metrics import summarize, tbt_misses
from superinfer_jax.sim.workloads import SLOClass, load_trace, poisson_arrivals, scale_lengths

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "superinfer", "xla")


def unloaded_latency(engine, prompt_len: int, vocab: int, runs: int = 7
                     ) -> tuple[float, float]:
    """(TTFT, decode step) of one request alone: the median of ``runs`` runs after one
    left out (the first request after warm-up pays for cold caches). With 3 runs and none
    left out, the TTFT SLO of session 22's multi-turn sweeps on one machine ranged from
    1,033 to 1,407 ms (unloaded TTFT 207-281 ms, its ratio to the decode step 7.7-10.4),
    and every attainment with it; ``--ttft-slo-ms`` / ``--tbt-slo-ms`` fix them instead."""
    from superinfer_jax import SamplingParams

    rng = np.random.default_rng(123)
    ttfts, steps = [], []
    for _ in range(runs + 1):
        rid = engine.add_request(rng.integers(10, vocab - 10, prompt_len).tolist(),
                                 SamplingParams(max_tokens=8, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        req = engine.release(rid)
        ttfts.append(req.ttft)
        steps.append(float(np.median(req.inter_token_gaps)))
    return float(np.median(ttfts[1:])), float(np.median(steps[1:]))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, "policy_sweep")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--policies", default="fcfs,swap,rotasched",
                        help="comma-separated registered names or package.module:Class "
                             "plug-ins (examples.edf_policy:EDFPolicy), each optionally "
                             "with :knob=value RotaSched overrides")
    parser.add_argument("--rates", default="0.5,1,2,3", help="requests per second "
                        "(--workload multiturn: conversations per second)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--trace", default="azure_conv")
    parser.add_argument("--scale", type=float, default=0.125, help="length scale factor")
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--max-output", type=int, default=48)
    parser.add_argument("--device-pages", type=int, default=48, help="device pool cap")
    parser.add_argument("--host-pages", type=int, default=512)
    parser.add_argument("--ttft-mult", type=float, default=5.0)
    parser.add_argument("--tbt-mult", type=float, default=3.0)
    parser.add_argument("--ttft-slo-ms", type=float, help="a fixed TTFT SLO instead of "
                        "--ttft-mult x the unloaded TTFT (to compare runs at equal SLOs)")
    parser.add_argument("--tbt-slo-ms", type=float, help="a fixed TBT SLO instead of "
                        "--tbt-mult x the unloaded decode step")
    parser.add_argument("--seeds", default="0,1,2",
                        help="workload seeds, pooled per row: e.g. 0,1,2 or 0-11 or 0-3,7")
    parser.add_argument("--compilation-cache", default=DEFAULT_CACHE)
    parser.add_argument("--speculative", help="comma-separated speculation settings, an "
                        "engine each: none, fixed:K, slo:K (n-gram proposals)")
    parser.add_argument("--max-num-seqs", default="16",
                        help="comma-separated batch caps, an engine each")
    add_multiturn_args(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        args.rates, args.num_requests, args.seeds = "1,3", 16, "0"
        args.num_conversations = min(args.num_conversations, 8)
    for flag in ("ttft_slo_ms", "tbt_slo_ms"):
        value = getattr(args, flag)
        if value is not None and not value > 0:
            parser.error(f"--{flag.replace('_', '-')} must be > 0, got {value}")
    if args.workload == "multiturn":
        try:
            multiturn_spec(args, 1.0, 0)  # bad values fail now, not after the model loads
        except ValueError as e:
            parser.error(str(e))
    from superinfer_jax.sched.rotasched.registry import resolve_policy
    from superinfer_jax.sim.presets import split_policy

    for policy in args.policies.split(","):
        try:  # a bad name, path or knob fails now, not after the model loads
            resolve_policy(split_policy(policy)[0])
        except ValueError as e:
            parser.error(str(e))
    try:
        args.variants = spec_sweep.variants(
            args.policies.split(","),
            spec_sweep.parse_settings(args.speculative) if args.speculative else None,
            spec_sweep.parse_max_num_seqs(args.max_num_seqs))
    except ValueError as e:
        parser.error(str(e))
    try:  # before the model loads
        seeds = parse_seeds(args.seeds)
    except ValueError:
        parser.error(f"--seeds: expected e.g. 0,1,2 or 0-11, got {args.seeds!r}")

    from models import load_model

    model = load_model(args.model)
    if args.workload == "multiturn":
        return sweep_multiturn(args, model, seeds)
    traces = trace_samples(args, seeds)
    median_prompt = int(np.median([r.prompt_len for r in traces[seeds[0]]]))

    def replay_seed(rate: float, seed: int, ttft_ms: float, tbt_ms: float):
        requests = build_requests(traces[seed], trace_arrivals(args, rate, seed),
                                  model.vocab_size, ttft_ms, tbt_ms, seed + 2)
        return lambda engine, desc: run_once(engine, requests, desc)

    rows, slo = sweep(args, model, median_prompt, seeds, replay_seed)
    report(args, rows, *slo)


def sweep(args: argparse.Namespace, model, median_prompt: int, seeds: list[int],
          replay_seed) -> tuple[list[dict], tuple[float, float, float, float]]:
    """Every rate, seed and engine variant; the pooled rows and the SLOs. Engines are
    built one ``max_num_seqs`` group at a time (the SLOs measured on the first group's,
    ``engines_and_slos``) and dropped before the next, so memory holds one group.
    ``replay_seed(rate, seed, ttft_ms, tbt_ms)``: the seed's workload, as a function
    ``(engine, desc) -> run result`` that every engine of the group replays in turn."""
    import gc

    import jax

    rows: list[dict] = []
    slo: tuple[float, float, float, float] | None = None
    variants = args.variants
    for group in dict.fromkeys(v.max_num_seqs for v in variants):
        args.variants = [v for v in variants if v.max_num_seqs == group]
        engines, measured = engines_and_slos(args, model, median_prompt, slo)
        slo = slo or measured
        for rate in [float(r) for r in args.rates.split(",")]:
            runs: dict[str, list] = {p: [] for p in engines}
            for turn, seed in enumerate(seeds):
                replay = replay_seed(rate, seed, slo[0], slo[1])
                for label in run_order(list(engines), turn):
                    runs[label].append(replay(engines[label], f"{label} @ {rate}/s #{seed}"))
            rows += sweep_rows(args, rate, runs, seeds)
        del engines, runs
        gc.collect()
        jax.clear_caches()  # the next group's programs load from the compilation cache
    args.variants = variants
    assert slo is not None
    return rows, slo


def trace_samples(args: argparse.Namespace, seeds: list[int]) -> dict[int, list]:
    """Per seed, ``--num-requests`` requests of the first 4x that many of ``--trace``,
    lengths scaled and clipped (``scale_lengths``): each seed samples others."""
    full = scale_lengths(load_trace(args.trace, limit=4 * args.num_requests),
                         args.max_prompt, args.max_output, args.scale)
    picks = {seed: np.random.default_rng(seed).choice(len(full), args.num_requests,
                                                      replace=False) for seed in seeds}
    return {seed: [full[i] for i in pick] for seed, pick in picks.items()}


def trace_arrivals(args: argparse.Namespace, rate: float, seed: int) -> np.ndarray:
    """The Poisson arrival times of seed ``seed``'s requests at ``rate``."""
    return poisson_arrivals(args.num_requests, rate, np.random.default_rng(seed + 1))


def run_order(policies: list[str], turn: int) -> list[str]:
    """The policies in the order the ``turn``-th seed of a rate runs them: rotated by one
    each seed, so that every policy runs first, second and third equally often. In a fixed
    order (fcfs, swap, rotasched) the last policy of every seed always ran after two
    others, and a box that slows within a triple charged it to that policy alone (the
    1 req/s light-load row of session 14's sweep: mean TTFT fcfs 349, swap 384,
    rotasched 394 ms; the CPU-calibrated simulator on the same workload, at every load
    where fcfs meets its SLOs, gives rotasched a mean TTFT of 0.96-1.0x fcfs's)."""
    k = turn % len(policies) if policies else 0
    return policies[k:] + policies[:k]


def engine_config(args: argparse.Namespace, max_num_seqs: int = 16, **knobs):
    """The engine every policy runs on (only the policy differs; ``--speculative`` and
    ``--max-num-seqs`` add ``max_num_seqs`` and the speculation ``knobs``)."""
    from superinfer_jax import EngineConfig

    return EngineConfig.build(
        max_model_len=args.max_prompt + args.max_output + 16, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=256, max_prefill_chunk=256, num_device_pages=args.device_pages,
        num_host_pages=args.host_pages, compilation_cache_dir=args.compilation_cache or None,
        enable_prefix_caching=True, **knobs,
    )


def engines_and_slos(args: argparse.Namespace, model, median_prompt: int,
                     known: tuple[float, float, float, float] | None = None
                     ) -> tuple[dict, tuple[float, float, float, float]]:
    """One engine per variant (``args.variants``: policy, speculation, ``max_num_seqs``)
    on ``engine_config``, and the SLOs: ``known``, else measured on the first without
    speculation, else the first (``slos``)."""
    from superinfer_jax import LLMEngine
    from superinfer_jax.sim.presets import with_policy

    engines = {v.label: LLMEngine(model, with_policy(
        engine_config(args, v.max_num_seqs, **v.setting.knobs()), v.policy))
        for v in args.variants}
    if known is not None:
        return engines, known
    first = next((v.label for v in args.variants if v.setting.mode == "none"),
                 args.variants[0].label)
    return engines, slos(args, engines[first], median_prompt, model.vocab_size)


def sweep_rows(args: argparse.Namespace, rate: float, runs: dict[str, list],
               seeds: list[int]) -> list[dict]:
    """One pooled row per engine variant at ``rate``, printed; with speculation settings
    or several ``max_num_seqs``, with ``spec_sweep.columns``."""
    rows = []
    by_label = {v.label: v for v in args.variants}
    for label, results in runs.items():
        row = pooled_row(label, rate, results)
        if _spec_sweep(args):
            row |= spec_sweep.columns(by_label[label], results, seeds, summarize)
        rows.append(row)
        print_table([{k: v for k, v in row.items() if k not in ("summary", "per_seed")}])
    return rows


def _spec_sweep(args: argparse.Namespace) -> bool:
    """Whether the engines differ in more than their policy."""
    return bool(args.speculative) or len(spec_sweep.parse_max_num_seqs(args.max_num_seqs)) > 1


def slos(args: argparse.Namespace, engine, median_prompt: int, vocab: int
         ) -> tuple[float, float, float, float]:
    """(TTFT SLO ms, TBT SLO ms, unloaded TTFT s, unloaded step s), printed. The SLOs
    are the multiples of the unloaded latencies, or ``--ttft-slo-ms`` / ``--tbt-slo-ms``
    where given (the unloaded latencies are measured and reported either way)."""
    ttft0, step0 = unloaded_latency(engine, median_prompt, vocab)
    ttft_ms = args.ttft_slo_ms or 1000 * args.ttft_mult * ttft0
    tbt_ms = args.tbt_slo_ms or 1000 * args.tbt_mult * step0
    fixed = [name for name, v in (("TTFT", args.ttft_slo_ms), ("TBT", args.tbt_slo_ms)) if v]
    print(f"unloaded TTFT {1000 * ttft0:.0f} ms (prompt {median_prompt}), decode step "
          f"{1000 * step0:.0f} ms -> SLOs TTFT {ttft_ms:.0f} ms, TBT {tbt_ms:.0f} ms"
          + (f" ({' and '.join(fixed)} fixed by flag)" if fixed else ""))
    return ttft_ms, tbt_ms, ttft0, step0


def report(args: argparse.Namespace, rows: list[dict], ttft_ms: float, tbt_ms: float,
           ttft0: float, step0: float) -> None:
    """The pooled table, the knee verdict, the JSON and the plot."""
    seeds = parse_seeds(args.seeds)
    table = [{k: v for k, v in r.items() if k not in ("summary", "per_seed")} for r in rows]
    print_table(table, title=f"policy sweep, {args.workload} workload ({len(seeds)} seed(s) "
                             f"pooled per row)")
    if _spec_sweep(args):
        verdict = spec_sweep.summary(rows)
        print_table([{k: v for k, v in r.items() if not k.startswith("seed_")}
                     for r in verdict["rows"]], title="speculation settings, paired runs")
    else:
        verdict = knee_verdict(rows)
    print(verdict["text"])
    settings = {k: v for k, v in vars(args).items() if k != "variants"}
    write_json(args.out, {"args": settings, "ttft_slo_ms": ttft_ms, "tbt_slo_ms": tbt_ms,
                          "unloaded_ttft_s": ttft0, "unloaded_step_s": step0, "rows": rows,
                          "verdict": verdict})
    plot(rows, os.path.splitext(args.out)[0] + ".png")


# -- the multi-turn workload ----------------------------------------------------------------


def add_multiturn_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", default="trace", choices=("trace", "multiturn"),
                        help="trace: --trace lengths, random prompts; multiturn: ShareGPT "
                             "conversations, closed loop, --rates in conversations/s")
    m = parser.add_argument_group("multi-turn (--workload multiturn)")
    m.add_argument("--num-conversations", type=int, default=16, help="per seed")
    m.add_argument("--think-time-s", type=float, default=1.0,
                   help="wait between an answer and the next turn (mean, or fixed)")
    m.add_argument("--think-time-dist", default="exponential", choices=THINK_DISTS)
    m.add_argument("--min-turns", type=int, default=2)
    m.add_argument("--max-turns", type=int)
    m.add_argument("--max-message-tokens", type=int, default=32,
                   help="cut every message and recorded reply to this many tokens")
    m.add_argument("--history", default="recorded", choices=HISTORIES,
                   help="assistant turns in later prompts: recorded replies or the tokens "
                        "the engine generated")
    m.add_argument("--sharegpt-path", help="ShareGPT JSON (default: the packaged one)")


def multiturn_spec(args: argparse.Namespace, rate: float, seed: int,
                   ttft_ms: float = 5000.0, tbt_ms: float = 100.0) -> MultiTurnSpec:
    """Turns fit the engine: prompt <= --max-prompt, prompt + reply <= --max-prompt +
    --max-output (the engine's max_model_len less its 16 spare tokens)."""
    return MultiTurnSpec(
        num_conversations=args.num_conversations, rate=rate, think_time_s=args.think_time_s,
        think_dist=args.think_time_dist, min_turns=args.min_turns, max_turns=args.max_turns,
        max_prompt=args.max_prompt, max_total=args.max_prompt + args.max_output,
        max_message_tokens=args.max_message_tokens, slo_mix=(SLOClass(1.0, ttft_ms, tbt_ms),),
        seed=seed, path=args.sharegpt_path)


def sweep_multiturn(args: argparse.Namespace, model, seeds: list[int]) -> None:
    """The sweep on ``--workload multiturn``: the same engines, SLO rule and rows as the
    trace sweep, plus conversations, turns and prefix-cache hits."""
    from superinfer_jax.sim.conversations import build_conversations
    from superinfer_jax.sim.sharegpt import load_conversations

    records, parse = load_conversations(args.sharegpt_path)
    notes = [f"sharegpt: {parse.describe()}"]
    first = build_conversations(records, model.tokenizer, multiturn_spec(args, 1.0, seeds[0]))
    median_prompt = int(np.median([c.prompt_len(k) for c in first
                                   for k in range(c.num_turns)]))

    def replay_seed(rate: float, seed: int, ttft_ms: float, tbt_ms: float):
        spec = multiturn_spec(args, rate, seed, ttft_ms, tbt_ms)
        convs = build_conversations(records, model.tokenizer, spec, notes)
        return lambda engine, desc: run_once_multiturn(engine, convs, args.history, desc)

    rows, slo = sweep(args, model, median_prompt, seeds, replay_seed)
    for note in dict.fromkeys(notes):
        print(note)
    report(args, rows, *slo)


def run_once_multiturn(engine, convs: list, history: str, desc: str) -> dict:
    """One closed-loop replay (``multiturn.replay_conversations``) under a fresh cache
    salt, so the run starts cold even on an engine that served these conversations at
    another rate; what ``run_once`` returns plus per-turn cached prompt tokens."""
    from serving.bench.multiturn import replay_conversations

    steps0, host0 = engine.num_model_steps, engine.total_host_time_s
    salt = f"sweep-{desc}-{time.time_ns()}"
    cache0, spec0 = _cache_counters(engine), spec_sweep.spec_counters(engine)
    with tqdm(total=sum(c.num_turns for c in convs), desc=desc, leave=False) as bar:
        t0 = time.perf_counter()
        runs, duration = replay_conversations(engine, convs, history, salt, bar.update)
    return {"timelines": [r.timeline for r in runs], "duration": duration,
            "wall_s": time.perf_counter() - t0,
            "steps": engine.num_model_steps - steps0,
            "host_s": engine.total_host_time_s - host0,
            "cache": _cache_delta(engine, cache0),
            "cached": [r.cached_tokens for r in runs], "conversations": len(convs),
            "spec": _spec_delta(engine, spec0)}


def run_once(engine, requests, desc: str) -> dict:
    """One replay: its timelines, wall time, model steps and host time. Under a fresh
    cache salt: every seed replays the same prompts at every rate on the same engines,
    and pages cached by an earlier run must not serve a later one."""
    steps0, host0 = engine.num_model_steps, engine.total_host_time_s
    salt = f"sweep-{desc}-{time.time_ns()}"
    requests = [dataclasses.replace(r, cache_salt=salt) for r in requests]
    cache0, spec0 = _cache_counters(engine), spec_sweep.spec_counters(engine)
    with tqdm(total=len(requests), desc=desc, leave=False) as bar:
        t0 = time.perf_counter()
        timelines, duration = replay(engine, requests, bar)
    return {"timelines": timelines, "duration": duration,
            "wall_s": time.perf_counter() - t0,
            "steps": engine.num_model_steps - steps0,
            "host_s": engine.total_host_time_s - host0,
            "cache": _cache_delta(engine, cache0), "spec": _spec_delta(engine, spec0)}


def _spec_delta(engine, before: tuple[int, int, int]) -> tuple[int, ...]:
    """Speculative drafts, proposed and accepted tokens during one run."""
    return tuple(b - a for a, b in zip(before, spec_sweep.spec_counters(engine), strict=True))


_CACHE_KEYS = ("prefix_cache_queries", "prefix_cache_hits", "prefix_cache_host_hits")


def _cache_counters(engine) -> dict[str, float]:
    stats = engine.stats()
    return {k: stats.get(k, 0) for k in _CACHE_KEYS}


def _cache_delta(engine, before: dict[str, float]) -> dict[str, float]:
    """Prefix-cache tokens looked up and found per tier during one run."""
    after = _cache_counters(engine)
    return {k: after[k] - before[k] for k in _CACHE_KEYS}


def pooled_row(policy: str, rate: float, results: list[dict]) -> dict:
    """One table row from every seed's run: timelines pooled, durations summed."""
    timelines = [t for r in results for t in r["timelines"]]
    s = summarize(timelines, sum(r["duration"] for r in results))
    missed, rotated = tbt_misses(timelines)
    steps = sum(r["steps"] for r in results)
    queried = sum(r.get("cache", {}).get("prefix_cache_queries", 0) for r in results)
    tiers = {f"hit_{tier}": sum(r.get("cache", {}).get(key, 0) for r in results) / queried
             if queried else 0.0
             for tier, key in (("dev", "prefix_cache_hits"), ("host", "prefix_cache_host_hits"))}
    return {"policy": policy, "rate": rate,
            "ttft_att": s["ttft_attainment"], "tbt_att": s["tbt_attainment"],
            "mean_ttft_ms": s["mean_ttft_ms"],
            "p50_ttft_ms": s["median_ttft_ms"], "p99_ttft_ms": s["p99_ttft_ms"],
            "p50_tbt_ms": s["median_itl_ms"], "p99_tbt_ms": s["p99_itl_ms"],
            "p99_stall_ms": s["p99_stall_ms"],
            "out_tok_s": s["output_throughput"], "rotations": s["num_rotations"],
            # of the TBT-missed gaps, the share that overlaps a rotation (the rest: slow
            # steps, on this CPU any step with a prefill chunk)
            "tbt_miss_rot": rotated / missed if missed else 0.0,
            "recomputed": s["recomputed_tokens"],
            "host_ms_step": 1000 * sum(r["host_s"] for r in results) / max(1, steps),
            "wall_s": sum(r["wall_s"] for r in results), "summary": s,
            **tiers, **multiturn_columns(results)}


def multiturn_columns(results: list[dict]) -> dict:
    """Conversations, turns, and prompt tokens served from the prefix cache (of the
    completed turns) with the hit rate, when the runs are multi-turn; else nothing."""
    if not results or not all("cached" in r for r in results):
        return {}
    pairs = [(t, n) for r in results for t, n in zip(r["timelines"], r["cached"], strict=True)]
    done = [(t, n) for t, n in pairs if t.ok and t.token_times and n is not None]
    hits, prompt = sum(n for _, n in done), sum(t.prompt_len for t, _ in done)
    return {"convs": sum(r["conversations"] for r in results), "turns": len(pairs),
            "cached_tok": hits, "hit_rate": hits / prompt if prompt else float("nan")}


def knee_verdict(rows: list[dict], policy: str = "rotasched", baseline: str = "fcfs") -> dict:
    """The issue's goals. At the knee, the first rate where the baseline's TTFT attainment
    is <= 60%: TTFT attainment >= 1.75x, TBT attainment at most 5 points lower,
    throughput >= 0.95x and P99 TBT <= 1.5x (its P99 TTFT over the baseline's reported
    beside, not judged). At every rate where the baseline meets its TTFT SLO (attainment
    >= 0.99): mean and P99 TTFT <= 1.1x (no price at light load)."""
    by = {(r["policy"], r["rate"]): r for r in rows}
    light = [_light_load(by[(policy, rate)], base) for (p, rate), base in sorted(by.items())
             if p == baseline and base["ttft_att"] >= 0.99 and (policy, rate) in by]
    light_met = all(x["met"] for x in light)
    light_text = "; ".join(x["text"] for x in light) or "no rate where it meets its SLO"
    knees = sorted(rate for (p, rate), r in by.items()
                   if p == baseline and r["ttft_att"] <= 0.6 and (policy, rate) in by)
    if not knees:
        return {"rate": None, "light": light, "met": False,
                "text": f"no rate brought {baseline} TTFT attainment to 60% or less: add "
                        f"higher rates. Light load, {policy}/{baseline}: {light_text}"}
    rate = knees[0]
    ours, base = by[(policy, rate)], by[(baseline, rate)]
    ttft_x = ours["ttft_att"] / max(base["ttft_att"], 1e-9)
    tbt_pts = 100 * (ours["tbt_att"] - base["tbt_att"])
    tput_x = ours["out_tok_s"] / base["out_tok_s"]
    tail_x = ours["p99_tbt_ms"] / base["p99_tbt_ms"]
    first_tail_x = ours["p99_ttft_ms"] / max(base["p99_ttft_ms"], 1e-9)  # reported only
    met = ttft_x >= 1.75 and tbt_pts >= -5 and tput_x >= 0.95 and tail_x <= 1.5 and light_met
    text = (f"knee {rate:g} req/s ({baseline} TTFT attainment {base['ttft_att']:.3f}): "
            f"{policy} TTFT attainment {ttft_x:.2f}x (goal >= 1.75), TBT attainment "
            f"{tbt_pts:+.1f} points (goal >= -5), output throughput {tput_x:.2f}x "
            f"(goal >= 0.95), P99 TBT {tail_x:.2f}x (goal <= 1.5), P99 TTFT "
            f"{first_tail_x:.2f}x; light load, mean and "
            f"P99 TTFT {policy}/{baseline} (goal <= 1.1): {light_text}: "
            f"{'met' if met else 'NOT met'}")
    return {"rate": rate, "ttft_ratio": ttft_x, "tbt_points": tbt_pts,
            "throughput_ratio": tput_x, "p99_tbt_ratio": tail_x,
            "p99_ttft_ratio": first_tail_x, "light": light,
            "met": met, "text": text}


def _light_load(ours: dict, base: dict) -> dict:
    """Mean and P99 TTFT of ``ours`` over ``base`` at one rate."""
    mean_x = ours["mean_ttft_ms"] / max(base["mean_ttft_ms"], 1e-9)
    p99_x = ours["p99_ttft_ms"] / max(base["p99_ttft_ms"], 1e-9)
    return {"rate": ours["rate"], "mean_ttft_ratio": mean_x, "p99_ttft_ratio": p99_x,
            "met": mean_x <= 1.1 and p99_x <= 1.1,
            "text": f"{ours['rate']:g} req/s {mean_x:.2f}x / {p99_x:.2f}x"}


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "ttft_att", "TTFT SLO attainment"),
                           (axes[1], "tbt_att", "TBT SLO attainment (share of gaps)")):
        for policy in dict.fromkeys(r["policy"] for r in rows):
            pts = [(r["rate"], r[key]) for r in rows if r["policy"] == policy]
            ax.plot(*zip(*pts, strict=True), marker="o", label=policy)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(title)
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
