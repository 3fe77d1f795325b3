"""Simulated policy sweeps at paper scale (``superinfer simulate``).

For each hardware preset, policy and request rate: build the workload (the same builder
as the serving benchmark, same seed per rate, so every policy sees the same requests),
run the discrete-event simulator (``superinfer_jax.sim``) and print one attainment row.

    superinfer simulate --preset paper-qwen32b-sharegpt            # GH200 and H200 PCIe
    superinfer simulate --preset paper-llama8b-sharegpt --hardware gh200-96g --quick
    superinfer simulate --model llama-3-8b --hardware gh200-96g --dataset sharegpt \\
        --rates 40 --num-requests 100000 --policies fcfs          # a speed run
    superinfer simulate --list
    superinfer simulate --preset paper-qwen32b-sharegpt --hardware gh200-96g --rates 20 \
        --duration-s 60 --policies fcfs,rotasched,examples.edf_policy:EDFPolicy  # a plug-in
    superinfer simulate --model smollm2-135m --dataset azure_conv --rates 1,2 \
        --latency-profile profile.json --num-device-pages 48 --num-host-pages 512 \
        --engine max_model_len=320 --engine max_num_seqs=16    # this machine, calibrated
    superinfer simulate --preset paper-llama8b-mooncake-conv \
        --hardware gh200-144g,h200-pcie --policies fcfs,rotasched  # prefix caching on/off
    superinfer simulate --preset paper-qwen32b-sharegpt --hardware gh200-96g \
        --policies rotasched --speculative none,fixed:1,fixed:3,fixed:5,slo:5 \
        --acceptance beta22,measured                   # speculative decoding policies
    superinfer simulate --preset paper-qwen32b-sharegpt --hardware gh200-96g \
        --weight-bytes 1 --kv-bytes 1 --matmul-speedup 2   # fp8 weights (FP8 GEMMs), fp8 KV

Speculation (``--speculative``, ``sim.speculation``): each request's acceptance rate is
drawn from Beta(2, 2) or from ``--acceptance-rates`` (``measured``; by default the
per-request rates of the CPU n-gram runs, ``sim/data/ngram_acceptance.json``); a row per
policy and acceptance model, with the
goodput (requests meeting both SLOs per second) and the acceptance achieved. Without
the option nothing changes.

A Mooncake trace (``mooncake_conv``, ``mooncake_synthetic``, or a JSONL file with
``hash_ids``) replays its own timestamps scaled to each rate, with its hash ids as prompt
content (``sim.mooncake``), so prefix caching has something to share: each
run is simulated with caching on and off (``--prefix-caching``), and the rows report the
hit rate (prompt tokens served from the cache) beside SLO attainment. Trace names resolve
to ``benchmarks/data/traces`` in a source checkout; elsewhere ``--dataset`` takes the
trace file's path.

Writes JSON (every summary) and a PNG (attainment against rate, one column per hardware).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import replace
from typing import Any

from superinfer_jax.sim.mooncake import BlockTrace, is_block_trace, load_block_trace
from superinfer_jax.sim.report import print_table, write_json
from superinfer_jax.sim.speculation import (
    MEASURED_DATA,
    MEASURED_RATES,
    SpeculationSpec,
    load_measured_rates,
)
from superinfer_jax.sim.workloads import (
    SLOClass,
    TokenizerLoader,
    WorkloadSpec,
    build_workload,
    parse_slo_mix,
)

ROW_KEYS = {  # table column -> summary key
    "ttft_att": "ttft_attainment", "tbt_att": "tbt_attainment", "slo_att": "slo_attainment",
    "mean_ttft_ms": "mean_ttft_ms", "p99_ttft_ms": "p99_ttft_ms", "p99_tbt_ms": "p99_itl_ms",
    "p99_stall_ms": "p99_stall_ms", "max_stall_ms": "max_stall_ms",
    "out_tok_s": "output_throughput", "rotations": "num_rotations",
    "recomputed": "recomputed_tokens", "sim_s": "sim_wall_s",
}
CACHING = {"on": (True,), "off": (False,), "both": (True, False)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", help="a paper-scale preset (see --list)")
    p.add_argument("--list", action="store_true", help="list the presets and exit")
    p.add_argument("--model", help="model preset (without --preset): "
                   "smollm2-135m, llama-3-8b, qwen2.5-32b, llama-3-70b-fp8, mixtral-8x7b, "
                   "mixtral-8x7b-fp8, qwen3-30b-a3b, qwen3-235b-a22b")
    p.add_argument("--dataset", help="sharegpt, random, azure_conv, azure_code, "
                   "mooncake_conv, mooncake_synthetic (trace names: in a source checkout) "
                   "or a trace file's path")
    p.add_argument("--hardware", help="comma-separated: gh200-96g, gh200-144g, h100-pcie, "
                   "h200-pcie, h100-nvl-pcie")
    p.add_argument("--policies", help="comma-separated: fcfs, swap, rotasched, another "
                   "registered name, or a plug-in as package.module:Class "
                   "(examples.edf_policy:EDFPolicy); each optionally followed by "
                   ":knob=value RotaSched overrides (rotasched:parked_replies=auto)")
    p.add_argument("--rates", help="comma-separated requests per second")
    p.add_argument("--duration-s", type=float, help="arrivals for this long (default 120)")
    p.add_argument("--num-requests", type=int, help="instead of --duration-s")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument("--ttft-ms", type=float, help="TTFT SLO (default 5000)")
    p.add_argument("--tbt-ms", type=float, help="TBT SLO (default 100)")
    p.add_argument("--slo-mix", help="weight:class:ttft_ms:tbt_ms,... (priority mix)")
    p.add_argument("--transfer-mode", default="duplex", choices=("duplex", "simplex", "naive"))
    p.add_argument("--pad", action=argparse.BooleanOptionalAction, default=None,
                   help="price prefill at the engine's padded buckets (default: ragged)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weight-bytes", type=float, help="bytes per weight parameter instead of "
                   "the model's (fp8 or int8 weights: 1; bf16: 2)")
    p.add_argument("--kv-bytes", type=int, help="bytes per KV cache element instead of the "
                   "model's (fp8 KV: 1; bf16: 2)")
    p.add_argument("--matmul-speedup", type=float, help="the weight matmuls' peak over "
                   "bf16's (fp8 weights as FP8 GEMMs on Hopper: 2; default 1)")
    p.add_argument("--prefix-caching", choices=sorted(CACHING),
                   help="simulate with prefix caching on, off, or both (a row each); "
                   "default: both on a trace with hash ids, else the engine's setting")
    p.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                   help="override an EngineConfig field (repeatable), e.g. max_num_seqs=256")
    c = p.add_argument_group("this machine (hardware this-machine)")
    c.add_argument("--latency-profile", help="LatencyModel JSON of the engine on this "
                   "machine (LatencyModel.save, or rotasched.latency_profile)")
    c.add_argument("--page-bytes", type=int, help="bytes of one KV page (default: the "
                   "--model preset's)")
    c.add_argument("--num-device-pages", type=int, help="the profiled engine's device pool")
    c.add_argument("--num-host-pages", type=int, default=0)
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--speculative", help="comma-separated: none, fixed:K (every row "
                   "proposes K), slo:K (per row, at most K, from its TBT slack and the "
                   "step's cost); a row each")
    s.add_argument("--acceptance", default="beta22", help="comma-separated acceptance "
                   "models: beta22 (rates drawn from Beta(2, 2)), measured (drawn from "
                   "--acceptance-rates); a row each")
    s.add_argument("--acceptance-rates", help="per-token acceptance rates for 'measured': "
                   "comma-separated, or a .json acceptance data file (default: the CPU "
                   f"n-gram runs' {len(MEASURED_RATES)} per-request rates, "
                   f"superinfer_jax/sim/data/{MEASURED_DATA})")
    p.add_argument("--quick", action="store_true", help="3 rates, 30 s of arrivals")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", help="JSON path (default results/simulate-<preset>.json)")


def _preset(args: argparse.Namespace):
    from superinfer_jax.sim.presets import THIS_MACHINE, SimPreset, get_preset

    if args.preset:
        preset = get_preset(args.preset)
    else:
        if not (args.model and args.dataset and args.rates):
            raise ValueError("give --preset, or --model, --dataset and --rates")
        preset = SimPreset("custom", "custom", args.model, args.dataset,
                           _floats(args.rates, "--rates"))
    changes: dict[str, Any] = {}
    if args.model and args.preset:
        changes["model"] = args.model
    if args.dataset and args.preset:
        changes["dataset"] = args.dataset
    if args.hardware:
        changes["hardware"] = tuple(_names(args.hardware))
    if args.policies:
        changes["policies"] = tuple(_names(args.policies))
    if args.rates:
        changes["rates"] = _floats(args.rates, "--rates")
    if args.ttft_ms is not None:
        changes["ttft_ms"] = args.ttft_ms
    if args.tbt_ms is not None:
        changes["tbt_ms"] = args.tbt_ms
    if args.duration_s is not None:
        changes["duration_s"] = args.duration_s
        changes["num_requests"] = None
    if args.num_requests is not None:
        changes["num_requests"] = args.num_requests
    if args.pad is not None:
        changes["pad"] = args.pad
    if getattr(args, "weight_bytes", None) is not None:
        if not args.weight_bytes > 0:
            raise ValueError(f"--weight-bytes must be positive, got {args.weight_bytes}")
        changes["weight_bytes_per_param"] = args.weight_bytes
    if getattr(args, "kv_bytes", None) is not None:
        if args.kv_bytes not in (1, 2, 4):
            raise ValueError(f"--kv-bytes must be 1, 2 or 4, got {args.kv_bytes}")
        changes["kv_bytes_per_elem"] = args.kv_bytes
    if getattr(args, "matmul_speedup", None) is not None:
        if not args.matmul_speedup > 0:
            raise ValueError(f"--matmul-speedup must be positive, got {args.matmul_speedup}")
        changes["matmul_speedup"] = args.matmul_speedup
    if args.engine:
        changes["engine"] = preset.engine.replace(**_engine_overrides(args.engine))
    if args.latency_profile:
        changes["calibration"] = _calibration(args, replace(preset, **changes))
        changes.setdefault("hardware", (THIS_MACHINE,))
    if args.quick:
        rates = changes.get("rates", preset.rates)
        changes["rates"] = tuple(rates[i] for i in sorted({0, len(rates) // 2,
                                                           len(rates) - 1}))
        changes["duration_s"] = min(30.0, changes.get("duration_s", preset.duration_s))
        if args.num_requests is None and preset.num_requests is not None \
                and args.duration_s is None:  # a preset's fixed count: its first 300
            changes["num_requests"] = min(300, preset.num_requests)
    return replace(preset, **changes)


def _engine_overrides(items: list[str]) -> dict[str, Any]:
    """``key=value`` strings -> EngineConfig fields, values as int, float, bool or str."""

    from superinfer_jax.config import EngineConfig
    from superinfer_jax.sim.presets import parse_scalar

    fields = EngineConfig.knob_names()
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise ValueError(f"--engine {item!r}: expected KEY=VALUE with KEY an EngineConfig "
                             f"field")
        out[key] = parse_scalar(value)
    return out


def _calibration(args: argparse.Namespace, preset):
    from superinfer_jax.sched.latency import LatencyModel
    from superinfer_jax.sim.presets import Calibration

    if args.num_device_pages is None:
        raise ValueError("--latency-profile needs --num-device-pages (the profiled pool)")
    page_bytes = args.page_bytes or preset.model_shape.page_bytes(preset.engine.hardware
                                                                   .page_size)
    return Calibration(LatencyModel.load(args.latency_profile), page_bytes,
                       args.num_device_pages, args.num_host_pages)


def _names(text: str) -> list[str]:
    out = [s.strip() for s in text.split(",") if s.strip()]
    if not out:
        raise ValueError(f"empty list {text!r}")
    return out


def _floats(text: str, flag: str) -> tuple[float, ...]:
    try:
        out = tuple(float(s) for s in _names(text))
    except ValueError as e:
        raise ValueError(f"{flag} must be comma-separated numbers, got {text!r}") from e
    if any(not v > 0 for v in out):
        raise ValueError(f"{flag} must be positive, got {text!r}")
    return out


def speculations(args: argparse.Namespace) -> list[SpeculationSpec | None]:
    """The ``--speculative`` x ``--acceptance`` runs ([None] without the option)."""
    if not getattr(args, "speculative", None):
        return [None]
    rates: tuple[float, ...] = MEASURED_RATES
    if args.acceptance_rates and args.acceptance_rates.endswith(".json"):
        rates = load_measured_rates(args.acceptance_rates)
    elif args.acceptance_rates:
        try:
            rates = tuple(float(x) for x in _names(args.acceptance_rates))
        except ValueError as e:
            raise ValueError(f"--acceptance-rates must be comma-separated numbers, got "
                             f"{args.acceptance_rates!r}") from e
    out: list[SpeculationSpec | None] = []
    for model in _names(args.acceptance):
        for text in _names(args.speculative):
            out.append(None if text == "none" else
                       SpeculationSpec.parse(text, model, rates, args.seed))
    return list(dict.fromkeys(out))


def workload_spec(preset, rate: float, args: argparse.Namespace) -> WorkloadSpec:
    mix = parse_slo_mix(args.slo_mix) if args.slo_mix else \
        (SLOClass(1.0, preset.ttft_ms, preset.tbt_ms),)
    return WorkloadSpec(
        dataset=preset.dataset, rate=rate, arrival="poisson" if args.burstiness == 1.0
        else "gamma", burstiness=args.burstiness,
        num_requests=preset.num_requests or 1,
        duration_s=None if preset.num_requests else preset.duration_s,
        max_prompt=min(preset.max_prompt, preset.engine.model.max_model_len - 1),
        max_total=preset.max_total, slo_mix=mix, seed=args.seed)


def to_specs(workload) -> list:
    from superinfer_jax.request import SLO
    from superinfer_jax.sim import RequestSpec

    slos: dict[tuple, SLO] = {}
    out = []
    for r in workload:
        key = (r.ttft_ms, r.tbt_ms, r.priority_class)
        slo = slos.setdefault(key, SLO(*key))
        out.append(RequestSpec(r.arrival_s, r.prompt_len, r.output_len, slo))
    return out


def block_trace(preset, rate: float, args: argparse.Namespace) -> BlockTrace:
    """The Mooncake replay of one rate: the preset's first ``num_requests`` (or those
    within ``duration_s``), timestamps scaled to ``rate``."""
    mix = parse_slo_mix(args.slo_mix) if args.slo_mix else \
        (SLOClass(1.0, preset.ttft_ms, preset.tbt_ms),)
    return BlockTrace(
        dataset=preset.dataset, rate=rate, num_requests=preset.num_requests,
        duration_s=None if preset.num_requests else preset.duration_s,
        max_prompt=min(preset.max_prompt, preset.engine.model.max_model_len - 1), slo_mix=mix,
        seed=args.seed)


def _workloads(preset, args: argparse.Namespace, notes: list[str],
               load_tokenizer: TokenizerLoader | None) -> dict[float, list]:
    if not is_block_trace(preset.dataset):
        return {rate: to_specs(build_workload(workload_spec(preset, rate, args),
                                              report=notes, load_tokenizer=load_tokenizer))
                for rate in preset.rates}
    from superinfer_jax.sim.stats import prefix_hit_ceiling

    out = {}
    for rate in preset.rates:
        specs, more = load_block_trace(block_trace(preset, rate, args))
        notes.extend(more)
        ceiling = prefix_hit_ceiling(specs, preset.engine.hardware.page_size)
        notes.append(f"{preset.dataset} at {rate:g} req/s: an unbounded prefix cache could "
                     f"serve {ceiling:.1%} of the prompt tokens")
        out[rate] = specs
    return out


def run_sweep(preset, args: argparse.Namespace,
              load_tokenizer: TokenizerLoader | None = None) -> list[dict[str, Any]]:
    from tqdm.auto import tqdm

    from superinfer_jax.sim.stats import summarize

    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    workloads = _workloads(preset, args, notes, load_tokenizer)
    for note in dict.fromkeys(notes):
        print(note)
    content = is_block_trace(preset.dataset)
    cachings = CACHING[args.prefix_caching or ("both" if content else "on" if
                                               preset.engine.prefix_caching.enabled else "off")]
    spec_runs = speculations(args)
    runs = [(hw, rate, pol, c, sp) for hw in preset.hardware for rate in preset.rates
            for pol in preset.policies for c in cachings for sp in spec_runs]
    bar = tqdm(runs, desc="simulating", disable=args.no_progress)
    for hw, rate, policy, caching, spec in bar:
        bar.set_postfix_str(f"{hw} {policy} @ {rate:g}/s")
        run_preset = replace(preset, engine=preset.engine.replace(
            enable_prefix_caching=caching))
        sim = run_preset.simulator(hw, policy, transfer_mode=args.transfer_mode,
                                   speculation=spec)
        specs = workloads[rate]
        with tqdm(total=len(specs), desc=f"{policy}@{rate:g}", leave=False,
                  disable=args.no_progress) as reqbar:
            result = sim.run(specs, progress=reqbar.update)
        s = summarize(result)
        row = {"hardware": hw, "policy": policy, "rate": rate, "requests": len(specs)}
        if content:
            row["cache"] = "on" if caching else "off"
        if spec_runs != [None]:
            row["spec"] = "none" if spec is None else spec.label
            row["accept"] = "-" if spec is None else spec.acceptance
        row.update({col: s[key] for col, key in ROW_KEYS.items()})
        if content:  # prompt tokens served from the cache (0 with caching off), and the
            # share of looked-up tokens the host tier served (after the device's hit)
            row["hit_rate"] = s.get("prefix_hit_rate", 0.0)
            row["host_hit"] = s.get("prefix_host_hit_rate", 0.0)
        if spec_runs != [None]:  # requests meeting both SLOs per second, and acceptance
            row["goodput"] = s["request_goodput"]
            row["acc_rate"] = s.get("spec_acceptance_rate", 0.0)
        rows.append({**row, "summary": s})
    return rows


def run(args: argparse.Namespace, load_tokenizer: TokenizerLoader | None = None) -> int:
    """The command; ``load_tokenizer`` loads the tokenizer that counts ShareGPT tokens
    (``serving.bench.sharegpt.default_tokenizer``: the engine layer loads no model)."""
    from superinfer_jax.sim.presets import PRESETS

    if args.list:
        width = max(len(name) for name in PRESETS)
        for p in PRESETS.values():
            print(f"{p.name:{width}s} {p.description}; rates {list(p.rates)} req/s; "
                  f"{', '.join(p.hardware)}")
        return 0
    preset = _preset(args)
    speculations(args)  # bad --speculative / --acceptance: an error before any work
    t0 = time.perf_counter()
    rows = run_sweep(preset, args, load_tokenizer)
    for hw in preset.hardware:
        print_table([{k: v for k, v in r.items() if k not in ("summary", "hardware")}
                     for r in rows if r["hardware"] == hw],
                    title=f"{preset.name} on {hw} ({preset.model}, {preset.dataset}, "
                          f"SLO TTFT {preset.ttft_ms:g} ms / TBT {preset.tbt_ms:g} ms)")
    print(f"\n{len(rows)} runs, {sum(r['requests'] for r in rows)} requests simulated in "
          f"{time.perf_counter() - t0:.1f} s")
    out = args.out or os.path.join("results", f"simulate-{preset.name}"
                                   f"{'-quick' if args.quick else ''}.json")
    write_json(out, {"preset": _preset_json(preset), "args": vars(args), "rows": rows})
    plot(rows, os.path.splitext(out)[0] + ".png", preset.name)
    return 0


def _preset_json(preset) -> dict[str, Any]:
    from dataclasses import asdict

    d = asdict(preset)
    d["engine"] = {k: v for k, v in d["engine"].items() if k != "rotasched"}
    return d


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hws = list(dict.fromkeys(r["hardware"] for r in rows))
    keys = (("ttft_att", "TTFT attainment"), ("tbt_att", "TBT attainment (gaps)"),
            ("slo_att", "both SLOs (requests)"))
    fig, axes = plt.subplots(len(keys), len(hws), figsize=(5 * len(hws), 9), squeeze=False)
    for j, hw in enumerate(hws):
        for i, (key, label) in enumerate(keys):
            ax = axes[i][j]
            for label in dict.fromkeys(_label(r) for r in rows):
                pts = [(r["rate"], r[key]) for r in rows
                       if r["hardware"] == hw and _label(r) == label]
                ax.plot(*zip(*pts, strict=True), marker="o", label=label,
                        linestyle="--" if label.endswith("no cache") else "-")
            ax.set_title(f"{hw}: {label}", fontsize=9)
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylim(0, 1.05)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def _label(row: dict[str, Any]) -> str:
    name = row["policy"] if "spec" not in row else \
        f"{row['policy']} spec {row['spec']} ({row['accept']})"
    return f"{name}, no cache" if row.get("cache") == "off" else name
