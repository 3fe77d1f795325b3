"""Speculative decoding on SmolLM2: decode tokens per second with and without it, in one
run, on the input-grounded workload (``benchmarks/data/speculative_grounded.jsonl``:
repeat, edit and quote a ShareGPT passage) and on plain ShareGPT chat.

Each prompt runs through the chat template on a baseline engine (no speculation) and on
the speculating engines, greedy, at batch 1 (one request at a time) and 8 at once
(``--batch``). The speculating engines: mode ``fixed`` at each k of ``--ks``, and mode
``slo`` (k per row and step from its acceptance rate, its TBT slack and the engine's
latency profile, up to ``--slo-k``; the profile is loaded from the compilation cache
directory, else measured first). Decode tok/s = output tokens after the first / the
time from the first token to the last, summed over the workload's requests;
``greedy_identical``: every request's tokens equal the baseline's. One JSON row per
(method, mode, workload, batch, k): ``tok_s``, ``baseline_tok_s``, ``acceptance_rate``
(accepted / proposed tokens, the engine's ``spec_decode`` counters),
``greedy_identical``, and ``per_request``: each request's guesses proposed, accepted
and its rejections (``benchmarks.lib.spec_acceptance``); workload ``grounded`` sums the
repeat, edit and quote rows. ``--acceptance-data PATH`` also writes the simulator's
``measured`` acceptance data from the fixed rows at ``--acceptance-k``. The
engines take turns on each group of ``batch`` prompts (baseline first).
Figures on a loaded machine say so in the docs that quote them.

``--methods draft`` adds the draft-model rows (``method: draft``, mode ``fixed``), on
the chat workload: the bfloat16 SmolLM2 as the target and the quantized self-draft (the
same model with int8 weights, ``--draft-quantization``) as the draft, every layer and,
per ``--draft-layers N``, its first N layers only, and per ``--draft-vocab N``, its head
cut to the N most frequent tokens (FR-Spec, ``speculative.draft_vocab``); their baseline
is the bfloat16 target alone, in the same run, the engines taking turns on each prompt.
Each draft row names its ``draft`` (quantization, layers and head tokens).

``--quick``: 2 prompts per kind, batch 1, fixed k = 3 and slo up to 3, 48 tokens; with
the default ``--methods ngram`` under 3 minutes on 2 idle cores, compiles included.
``--build-data`` rewrites the committed workload (seed 0).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

from benchmarks.lib import spec_acceptance, spec_workload
from benchmarks.lib.common import add_common_args, print_table, write_json


def _engine(model: Any, args: argparse.Namespace, method: str, k: int, batch: int,
            mode: str = "fixed", draft: tuple[Any, dict[str, Any]] | None = None):
    """An engine for ``method``; ``draft``: the draft model and its ``speculative`` knobs."""
    from superinfer_jax import EngineConfig, LLMEngine

    knobs: dict[str, Any] = dict(
        max_model_len=args.max_model_len, max_num_seqs=max(batch, 1),
        max_num_batched_tokens=256, max_prefill_chunk=256, max_prefill_rows=1,
        page_size=16, show_progress=False, warmup=False,
        compilation_cache_dir=os.path.join(tempfile.gettempdir(), "superinfer-spec-bench"))
    if method != "none":
        knobs.update(speculative_method=method, num_speculative_tokens=k,
                     speculative_mode=mode)
    if draft is not None:
        knobs.update(draft[1])
    engine = LLMEngine(model, EngineConfig.build(**knobs),
                       draft_model=None if draft is None else draft[0])
    if mode == "slo":  # it prices steps with the latency model: loaded, else measured
        _set_latency(engine)
    return engine


def _set_latency(engine: Any) -> None:
    """The engine's latency profile as warm-up would set it (kept with the compilation
    cache, so later runs load it)."""
    from superinfer_jax.runner.profiler import (
        latency_profile_path,
        load_latency_model,
        profile_engine,
        save_latency_model,
    )

    path = latency_profile_path(engine.config, engine.intake.model_identity)
    latency = load_latency_model(path)
    if latency is None:
        latency = profile_engine(engine)
        save_latency_model(latency, path)
    engine.set_latency_model(latency)


def _warm(engine: Any, tokenizer: Any) -> None:
    """Compile what the timed runs use (decode, verify, a prefill) before timing."""
    from superinfer_jax import SamplingParams

    if engine.spec is not None:
        engine.spec.warmup()
    prompt = tokenizer.encode("one two three four one two three four one two three")
    for speculative in (True, False):  # verify rows, then plain decode rows
        engine.add_request(prompt, SamplingParams(max_tokens=12, speculative=speculative))
        while engine.has_unfinished_requests():
            engine.step()


def _counters(engine: Any) -> tuple[int, int, int]:
    spec = engine.stats().spec_decode
    return spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens


Run = tuple[list[list[int]], int, float, list[dict[str, int]]]


def _run(engine: Any, prompts: list[list[int]], batch: int, max_tokens: int) -> Run:
    """Every prompt, ``batch`` at a time; (tokens per prompt, decode tokens, seconds,
    each request's speculation counters: ``spec_acceptance.request_counts``)."""
    from superinfer_jax import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens)
    outputs: list[list[int]] = []
    counts: list[dict[str, int]] = []
    tokens, seconds = 0, 0.0
    for i in range(0, len(prompts), batch):
        ids = [engine.add_request(p, sp) for p in prompts[i:i + batch]]
        first: float | None = None
        while engine.has_unfinished_requests():
            out = engine.step()
            if first is None and out:
                first = time.perf_counter()
        end = time.perf_counter()
        done = [engine.release(r) for r in ids]
        outputs += [r.output_token_ids for r in done]
        counts += [spec_acceptance.request_counts(r) for r in done]
        tokens += sum(len(r.output_token_ids) for r in done) - len(done)
        seconds += end - (first or end)
    return outputs, tokens, seconds, counts


def _prompts(tokenizer: Any, rows: list[dict[str, str]]) -> list[list[int]]:
    return [tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": r["prompt"]}])) for r in rows]


def _workloads(args: argparse.Namespace) -> dict[str, list[dict[str, str]]]:
    rows = spec_workload.load()
    per_kind = 2 if args.quick else args.per_kind
    out = {kind: [r for r in rows if r["kind"] == kind][:per_kind]
           for kind in spec_workload.KINDS}
    out["chat"] = spec_workload.chat(per_kind)
    return out


def _row(workload: str, batch: int, mode: str, k: int, sums: dict[str, Any],
         method: str = "ngram", draft: str | None = None) -> dict[str, Any]:
    """One JSON row from a workload's summed counts (see the module docstring)."""
    tok_s = sums["tokens"] / sums["seconds"] if sums["seconds"] else 0.0
    base = sums["base_tokens"] / sums["base_seconds"] if sums["base_seconds"] else 0.0
    extra = {} if draft is None else {"draft": draft}
    return {"method": method, "mode": mode, "workload": workload, "batch": batch, "k": k,
            **extra,
            "requests": sums["requests"], "tok_s": round(tok_s, 2),
            "baseline_tok_s": round(base, 2), "speedup": round(tok_s / max(base, 1e-9), 3),
            "acceptance_rate": round(sums["accepted"] / max(sums["proposed"], 1), 4),
            "mean_accepted_per_draft": round(sums["accepted"] / max(sums["drafts"], 1), 3),
            "greedy_identical": sums["identical"],
            "per_request": sums.get("per_request", [])}


def _interleaved(base: Any, engines: dict[tuple[str, int], Any], prompts: list[list[int]],
                 batch: int, max_tokens: int) -> dict[Any, Run]:
    """Each group of ``batch`` prompts on the baseline (key None), then on every
    speculating engine in turn, summed per engine: a load that drifts during the run
    weighs on both sides of each ratio alike."""
    out: dict[Any, Run] = {}
    for i in range(0, len(prompts), batch):
        for key, engine in ((None, base), *engines.items()):
            got, tokens, seconds, counts = _run(engine, prompts[i:i + batch], batch,
                                                max_tokens)
            had, had_tokens, had_s, had_counts = out.get(key, ([], 0, 0.0, []))
            out[key] = (had + got, had_tokens + tokens, had_s + seconds, had_counts + counts)
    return out


def _measure(model: Any, args: argparse.Namespace, batch: int) -> list[dict[str, Any]]:
    """Every workload's rows at ``batch``, and ``grounded``: its three kinds together."""
    base = _engine(model, args, "none", 0, batch)
    engines = {("fixed", k): _engine(model, args, "ngram", k, batch) for k in args.ks}
    if "slo" in args.modes:
        engines["slo", args.slo_k] = _engine(model, args, "ngram", args.slo_k, batch, "slo")
    for engine in (base, *engines.values()):
        _warm(engine, model.tokenizer)
    rows = []
    grounded: dict[tuple[str, int], dict[str, Any]] = {}
    for workload, items in _workloads(args).items():
        prompts = _prompts(model.tokenizer, items)
        before = {key: _counters(engine) for key, engine in engines.items()}
        runs = _interleaved(base, engines, prompts, batch, args.max_tokens)
        want, base_tokens, base_s, _ = runs.pop(None)
        for (mode, k), (got, tokens, seconds, counts) in runs.items():
            drafts, proposed, accepted = (b - a for a, b in zip(
                before[mode, k], _counters(engines[mode, k]), strict=True))
            sums = {"requests": len(prompts), "tokens": tokens, "seconds": seconds,
                    "base_tokens": base_tokens, "base_seconds": base_s, "drafts": drafts,
                    "proposed": proposed, "accepted": accepted, "identical": got == want,
                    "per_request": [c | {"workload": workload} for c in counts]}
            rows.append(_row(workload, batch, mode, k, sums))
            print({k: v for k, v in rows[-1].items() if k != "per_request"}, file=sys.stderr,
                  flush=True)
            if workload in spec_workload.KINDS:
                total = grounded.setdefault((mode, k), dict.fromkeys(sums, 0)
                                            | {"identical": True, "per_request": []})
                for key, value in sums.items():
                    total[key] = (total[key] and value) if key == "identical" \
                        else total[key] + value
    rows += [_row("grounded", batch, mode, k, sums) for (mode, k), sums in grounded.items()]
    return rows


def _measure_draft(args: argparse.Namespace, batch: int) -> list[dict[str, Any]]:
    """The quantized self-draft's rows on the chat workload: the bfloat16 target alone
    (the baseline) and with each draft (layers x head tokens) at each k, interleaved."""
    from models import load_model
    from models.draft import load_draft
    from superinfer_jax import EngineConfig

    target = load_model("smollm2-135m", dtype="bfloat16")
    base = _engine(target, args, "none", 0, batch)
    engines: dict[tuple[str, int], Any] = {}
    for layers in args.draft_layers:
        for vocab in args.draft_vocab:
            knobs = {"speculative_draft_model": "smollm2-135m",
                     "speculative_draft_quantization": args.draft_quantization,
                     "speculative_draft_layers": layers or None,
                     "speculative_draft_vocab": vocab or None}
            spec = EngineConfig.build(speculative_method="draft", **knobs).speculative
            name = (f"{args.draft_quantization} {layers or target.config.num_layers} layers, "
                    f"{vocab or target.vocab_size} head tokens")
            model = load_draft(spec, "bfloat16")
            for k in args.ks:
                engines[name, k] = _engine(target, args, "draft", k, batch,
                                           draft=(model, knobs))
    for engine in (base, *engines.values()):
        _warm(engine, target.tokenizer)
    prompts = _prompts(target.tokenizer, _workloads(args)["chat"])
    before = {key: _counters(engine) for key, engine in engines.items()}
    runs = _interleaved(base, engines, prompts, batch, args.max_tokens)
    want, base_tokens, base_s, _ = runs.pop(None)
    rows = []
    for (name, k), (got, tokens, seconds, counts) in runs.items():
        drafts_n, proposed, accepted = (b - a for a, b in zip(
            before[name, k], _counters(engines[name, k]), strict=True))
        rows.append(_row("chat", batch, "fixed", k, {
            "requests": len(prompts), "tokens": tokens, "seconds": seconds,
            "base_tokens": base_tokens, "base_seconds": base_s, "drafts": drafts_n,
            "proposed": proposed, "accepted": accepted, "identical": got == want,
            "per_request": [c | {"workload": "chat"} for c in counts]},
            method="draft", draft=name))
        print({k: v for k, v in rows[-1].items() if k != "per_request"}, file=sys.stderr,
              flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.speculative",
                                     description=__doc__.split("\n\n")[0])
    add_common_args(parser, "speculative")
    parser.add_argument("--methods", nargs="+", default=["ngram"], choices=("ngram", "draft"),
                        help="which proposers' rows (draft: the quantized self-draft)")
    parser.add_argument("--draft-quantization", default="int8",
                        choices=("int8", "fp8", "w8a8_int8"))
    parser.add_argument("--draft-layers", type=int, nargs="+", default=[0],
                        help="draft rows: the self-draft's first N layers (0: all)")
    parser.add_argument("--draft-vocab", type=int, nargs="+", default=[0],
                        help="draft rows: the self-draft's head scores only the N most "
                        "frequent tokens (speculative.draft_vocab; 0: all)")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 3, 5],
                        help="speculation lengths (--quick: 3)")
    parser.add_argument("--modes", nargs="+", choices=("fixed", "slo"),
                        default=["fixed", "slo"],
                        help="fixed: one row per k in --ks; slo: one row at --slo-k")
    parser.add_argument("--slo-k", type=int, default=5,
                        help="mode slo: the most tokens a row proposes (--quick: 3)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8],
                        help="requests at once (--quick: 1)")
    parser.add_argument("--per-kind", type=int, default=8,
                        help="prompts per workload kind (--quick: 2)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the n-gram rows' SmolLM2 weights (bfloat16: the native "
                        "kernels' path, where exactness rests on batch-invariant decode rows)")
    parser.add_argument("--max-tokens", type=int, default=128, help="(--quick: 48)")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--acceptance-data", metavar="PATH",
                        help="also write the simulator's measured acceptance data (each "
                        "request's per-token rate, benchmarks.lib.spec_acceptance) from the "
                        "n-gram fixed rows at --acceptance-k, e.g. "
                        "superinfer_jax/sim/data/ngram_acceptance.json")
    parser.add_argument("--acceptance-k", type=int, default=3,
                        help="which fixed k's rows feed --acceptance-data")
    parser.add_argument("--build-data", action="store_true",
                        help="rewrite the committed workload (seed 0) and exit")
    args = parser.parse_args(argv)
    if args.build_data:
        spec_workload.write()
        print(f"wrote {spec_workload.DATA}")
        return 0
    if args.quick:
        args.ks, args.max_tokens, args.slo_k, args.batch = [3], 48, 3, [1]
    if args.acceptance_data and ("ngram" not in args.methods or "fixed" not in args.modes
                                 or args.acceptance_k not in args.ks):
        parser.error(f"--acceptance-data needs the n-gram fixed rows at --acceptance-k "
                     f"{args.acceptance_k}: --methods ngram, --modes fixed and --ks with it")
    load_start = os.getloadavg()[0]
    from models import load_model

    rows = []
    if "ngram" in args.methods:
        model = load_model("smollm2-135m", dtype=args.dtype)
        for batch in args.batch:
            rows += _measure(model, args, batch)
    if "draft" in args.methods:
        for batch in args.batch:
            rows += _measure_draft(args, batch)
    print_table([{k: v for k, v in r.items() if k != "per_request"} for r in rows],
                "speculative decoding, SmolLM2 (decode tok/s)")
    result = {"benchmark": "speculative", "quick": args.quick, "dtype": args.dtype,
              "max_tokens": args.max_tokens, "rows": rows}
    write_json(args.out, result)
    if args.acceptance_data:
        spec_acceptance.write(args.acceptance_data, result, args.acceptance_k,
                              (load_start, os.getloadavg()[0]))
    return 0 if all(r["greedy_identical"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
