"""Latency metrics of a simulation, with the keys and definitions of ``sim.metrics``.

Building one ``Timeline`` per request costs seconds and gigabytes at 100,000 requests, so
the same numbers are computed here from the compact token-time arrays with numpy (the
distributions by ``metrics.dist``). A test checks that both give identical summaries on
the same timelines.

TTFT = first token - arrival; ITL = every gap between consecutive tokens; TPOT = (last -
first) / (tokens - 1) per request; E2E = last token - arrival. A request meets its TTFT
SLO when TTFT <= ttft_ms; TBT attainment is the share of all gaps within their request's
tbt_ms; goodput counts requests per second meeting both.

Prefix caching (only for a run that had the cache, so a run without content summarizes
exactly as before): ``prefix_hit_rate`` is prompt tokens served from the cache at each
request's first admission over all prompt tokens (``Request.num_cached_tokens``, what the
engine reports as cached tokens in usage); ``prefix_device_hit_rate`` and
``prefix_host_hit_rate`` split the cache's own counters (hits over lookups, every
admission, re-admissions after preemption included) by the tier the pages came from.

Speculation (only for a run that had it): ``spec_*`` counters (``sim.speculation``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from superinfer_jax.sim.metrics import dist, stall_dist
from superinfer_jax.sim.simulator import RequestSpec, SimResult


def summarize(result: SimResult) -> dict[str, Any]:
    """``metrics.summarize`` keys for a simulated run, plus simulator counters."""
    reqs = [r for r in result.requests if len(r.token_times)]
    counts = np.array([len(r.token_times) for r in reqs], np.int64)
    arrival = np.array([r.arrival_time for r in reqs])
    first = np.array([r.token_times[0] for r in reqs])
    last = np.array([r.token_times[-1] for r in reqs])
    ttft_slo = np.array([r.slo.ttft_s for r in reqs])
    tbt_slo = np.array([r.slo.tbt_s for r in reqs])
    # SimRequest.token_times is an array("d"): read in place, not copied
    gaps = [np.diff(np.frombuffer(r.token_times, np.float64))  # type: ignore[call-overload]
            for r in reqs]
    itl = np.concatenate(gaps) if gaps else np.zeros(0)
    gap_owner = np.repeat(np.arange(len(reqs)), np.maximum(counts - 1, 0))
    gap_ok = itl <= tbt_slo[gap_owner] if itl.size else np.zeros(0, bool)
    bad_gaps = np.bincount(gap_owner[~gap_ok], minlength=len(reqs)) if reqs else np.zeros(0)
    ttft = first - arrival
    meets_ttft = ttft <= ttft_slo
    good = meets_ttft & (bad_gaps == 0)
    multi = counts > 1
    tpot = (last[multi] - first[multi]) / (counts[multi] - 1)
    duration = result.duration_s if result.duration_s > 0 else float("nan")
    n_all = len(result.requests)
    out_tokens = int(counts.sum())
    in_tokens = sum(len(r.prompt_token_ids) for r in reqs)
    out = {
        "completed": len(reqs),
        "failed": n_all - len(reqs),
        "duration": result.duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(reqs) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + in_tokens) / duration,
        "request_goodput": int(good.sum()) / duration,
        "ttft_attainment": int(meets_ttft.sum()) / max(1, n_all),
        "tbt_attainment": float(gap_ok.mean()) if itl.size else float("nan"),
        "slo_attainment": int(good.sum()) / max(1, n_all),
        "num_rotations": sum(r.num_rotations for r in result.requests),
        "recomputed_tokens": sum(r.num_recomputed_tokens for r in result.requests),
    }
    for prefix, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl),
                           ("e2el", last - arrival)):
        out.update(dist(prefix, values))
    longest = np.array([g.max() for g, n in zip(gaps, counts, strict=True) if n > 1])
    out.update(stall_dist(longest, longest / tbt_slo[multi]))
    out.update(_counters(result))
    if result.prefix_caching:
        out.update(_prefix(result))
    if result.speculation is not None:
        out.update(result.speculation)
    return out


def _prefix(result: SimResult) -> dict[str, Any]:
    cached = sum(r.num_cached_tokens for r in result.requests)
    prompt = sum(len(r.prompt_token_ids) for r in result.requests)
    queries = result.prefix_cache_queries
    return {
        "prefix_cached_tokens": cached,
        "prefix_hit_rate": cached / prompt if prompt else 0.0,
        "prefix_cache_queries": queries,
        "prefix_cache_hits": result.prefix_cache_device_hits + result.prefix_cache_host_hits,
        "prefix_device_hit_rate": result.prefix_cache_device_hits / queries if queries
        else 0.0,
        "prefix_host_hit_rate": result.prefix_cache_host_hits / queries if queries else 0.0,
        "prefix_hit_pages_in": result.prefix_hit_pages_in,
    }


def _counters(result: SimResult) -> dict[str, Any]:
    return {
        "num_preemptions": sum(r.num_preemptions for r in result.requests),
        "num_steps": result.num_steps,
        "pages_out": result.pages_out,
        "pages_in": result.pages_in,
        "shadow_pages": result.shadow_pages,
        "link_busy_out_s": result.link_busy_s[0],
        "link_busy_in_s": result.link_busy_s[1],
        "num_device_pages": result.num_device_pages,
        "num_host_pages": result.num_host_pages,
        "sim_wall_s": result.wall_s,
    }


def prefix_hit_ceiling(specs: Sequence[RequestSpec], page_size: int) -> float:
    """The hit rate of an unbounded cache that every earlier request filled in time: per
    request, the full pages an earlier prompt shares with it (by common leading hash ids,
    within that prompt's length), at most up to its last token, over all prompt tokens.
    A run's ``prefix_hit_rate`` stays at or under it; the gap is what eviction, timing
    (a prefix still being computed is not findable yet) and tiers cost."""
    children: dict[tuple[int, int], int] = {}  # (node, hash id) -> node; node 0: root
    covered: list[int] = [0]  # node -> most tokens an earlier prompt had through it
    hits = total = 0
    for s in specs:
        total += s.prompt_len
        if s.hash_ids is None:
            continue
        b, node, best = s.block_tokens, 0, 0
        for h in s.hash_ids:
            child = children.get((node, h))
            if child is None:
                break
            node = child
            best = max(best, covered[node])
        hits += min(best // page_size, (s.prompt_len - 1) // page_size) * page_size
        node = 0
        for depth, h in enumerate(s.hash_ids, start=1):
            child = children.get((node, h))
            if child is None:
                child = children[(node, h)] = len(covered)
                covered.append(0)
            node = child
            covered[node] = max(covered[node], min(depth * b, s.prompt_len))
    return hits / total if total else 0.0
