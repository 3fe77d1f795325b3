"""Latency metrics from per-request timelines, as ``vllm bench serve`` defines them.

A timeline is the request's arrival and the time each output token reached the client.
TTFT = first token - arrival; ITL = every gap between consecutive tokens; TPOT = (last -
first) / (tokens - 1) per request; E2E = last token - arrival. SLO attainment: a request
meets its TTFT SLO when TTFT <= ttft_ms; TBT attainment is the share of all gaps within
their request's tbt_ms; goodput counts requests per second meeting every SLO given.
``tbt_misses``: the missed gaps, and how many of them overlap a span the request spent
off the device (rotated out, parked, rotating back in), so a report can tell the TBT
that rotation costs from the TBT that slow steps cost (on the CPU engine any step with
a prefill chunk misses a 3x-decode-step SLO for every decoder in it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Timeline:
    arrival: float  # seconds
    token_times: list[float]  # seconds, one per output token
    prompt_len: int
    ttft_slo_s: float | None = None
    tbt_slo_s: float | None = None
    num_rotations: int = 0
    num_recomputed_tokens: int = 0
    ok: bool = True  # False: failed or aborted
    # Client side, ``token_times`` are chunk arrivals and a chunk may carry several
    # tokens: then the server's token count goes here (TPOT and token throughput use it).
    num_output_tokens: int | None = None
    # (start, end) seconds the request spent off the device, from rotate-out to running
    # again (``parked_spans``; empty where unknown, e.g. client side)
    parked: list[tuple[float, float]] = field(default_factory=list)

    @property
    def output_tokens(self) -> int:
        return len(self.token_times) if self.num_output_tokens is None \
            else self.num_output_tokens

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def gaps(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    def meets_ttft(self) -> bool:
        return self.ok and self.ttft is not None and (
            self.ttft_slo_s is None or self.ttft <= self.ttft_slo_s)

    def missed_gaps(self) -> list[tuple[float, float]]:
        """(start, end) of every gap over the TBT SLO (none without an SLO)."""
        slo, t = self.tbt_slo_s, self.token_times
        if slo is None:
            return []
        return [(a, b) for a, b in zip(t, t[1:], strict=False) if b - a > slo]

    def rotated(self, start: float, end: float) -> bool:
        """Whether the gap from ``start`` to ``end`` overlaps a parked span (a rotate-out
        decided while the gap's first token was in flight starts just before it)."""
        return any(s < end and e > start for s, e in self.parked)

    def meets_tbt(self) -> bool:
        return self.ok and not self.missed_gaps()


def dist(prefix: str, values: Sequence[float] | np.ndarray, scale: float = 1000.0
         ) -> dict[str, float]:
    """mean/median/std/p90/p99 in ms (vLLM's key names: mean_ttft_ms, p99_itl_ms, ...);
    ``values`` in seconds, a list or an array."""
    v = np.asarray(values) * scale
    if v.size == 0:
        return {f"{k}_{prefix}_ms": float("nan") for k in ("mean", "median", "std", "p90",
                                                          "p99")}
    return {
        f"mean_{prefix}_ms": float(v.mean()),
        f"median_{prefix}_ms": float(np.median(v)),
        f"std_{prefix}_ms": float(v.std()),
        f"p90_{prefix}_ms": float(np.percentile(v, 90)),
        f"p99_{prefix}_ms": float(np.percentile(v, 99)),
    }


def summarize(timelines: list[Timeline], duration_s: float) -> dict[str, float]:
    """vLLM-style result keys plus ours (attainment, rotations, recomputation)."""
    done = [t for t in timelines if t.ok and t.token_times]
    ttfts = [t.token_times[0] - t.arrival for t in done]
    itls = [g for t in done for g in t.gaps]
    tpots = [(t.token_times[-1] - t.token_times[0]) / (t.output_tokens - 1)
             for t in done if t.output_tokens > 1]
    e2e = [t.token_times[-1] - t.arrival for t in done]
    out_tokens = sum(t.output_tokens for t in done)
    gaps_ok = sum(g <= t.tbt_slo_s for t in done if t.tbt_slo_s is not None for g in t.gaps)
    gaps_all = sum(len(t.gaps) for t in done if t.tbt_slo_s is not None)
    good = [t for t in timelines if t.meets_ttft() and t.meets_tbt()]
    result = {
        "completed": len(done),
        "failed": len(timelines) - len(done),
        "duration": duration_s,
        "total_input_tokens": sum(t.prompt_len for t in done),
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration_s,
        "output_throughput": out_tokens / duration_s,
        "total_token_throughput": (out_tokens + sum(t.prompt_len for t in done)) / duration_s,
        "request_goodput": len(good) / duration_s,
        "ttft_attainment": sum(t.meets_ttft() for t in timelines) / max(1, len(timelines)),
        "tbt_attainment": gaps_ok / gaps_all if gaps_all else float("nan"),
        "slo_attainment": len(good) / max(1, len(timelines)),
        "num_rotations": sum(t.num_rotations for t in timelines),
        "recomputed_tokens": sum(t.num_recomputed_tokens for t in timelines),
    }
    for prefix, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2e)):
        result.update(dist(prefix, values))
    stalls = [(max(t.gaps), t.tbt_slo_s) for t in done if len(t.token_times) > 1]
    result.update(stall_dist([g for g, _ in stalls],
                             [g / slo for g, slo in stalls if slo is not None]))
    return result


def stall_dist(longest_gaps: Sequence[float] | np.ndarray,
               in_slos: Sequence[float] | np.ndarray) -> dict[str, float]:
    """The longest gap of each request (what a user sees as a freeze): its distribution
    in ms (``*_stall_ms``), its maximum, and its P99 in units of the request's TBT SLO."""
    out = dist("stall", longest_gaps)
    gaps, slos = np.asarray(longest_gaps), np.asarray(in_slos)
    out["max_stall_ms"] = float(gaps.max() * 1000.0) if gaps.size else float("nan")
    out["p99_stall_tbt_slos"] = float(np.percentile(slos, 99)) if slos.size else float("nan")
    return out


def tbt_misses(timelines: list[Timeline]) -> tuple[int, int]:
    """(missed gaps, those of them that overlap a parked span) over the completed
    timelines (``summarize``'s ``tbt_attainment`` counts the same gaps)."""
    missed = [(t, g) for t in timelines if t.ok and t.token_times for g in t.missed_gaps()]
    return len(missed), sum(t.rotated(*g) for t, g in missed)


def parked_spans(transitions: Iterable[tuple[float, object]]) -> list[tuple[float, float]]:
    """The spans a request spent off the device, from its status log
    (``Request.transitions``): each from a rotate-out (or the first parked or rotating-in
    entry) to the next entry of another status (running again, or requeued, or
    finished)."""
    from superinfer_jax.request import ROTARY, ROTATING_IN, ROTATING_OUT

    spans, start, last = [], None, None
    for t, status in transitions:
        last = t
        if status in (ROTATING_OUT, ROTARY, ROTATING_IN):
            if start is None:
                start = t
        elif start is not None:
            spans.append((start, t))
            start = None
    if start is not None and last is not None:
        spans.append((start, last))
    return spans


def vllm_goodput(timelines: list[Timeline], duration_s: float, ttft_ms: float | None = None,
                 tpot_ms: float | None = None, e2el_ms: float | None = None) -> float:
    """``vllm bench serve --goodput``: completed requests per second whose TTFT, TPOT and
    E2E latency are each within the bound given (bounds not given are not checked).
    Unlike ``request_goodput`` above, TPOT is the request's *mean* time per output token,
    not every gap."""
    good = 0
    for t in timelines:
        if not (t.ok and t.token_times):
            continue
        tpot = ((t.token_times[-1] - t.token_times[0]) / (t.output_tokens - 1)
                if t.output_tokens > 1 else 0.0)
        checks = ((ttft_ms, t.token_times[0] - t.arrival), (tpot_ms, tpot),
                  (e2el_ms, t.token_times[-1] - t.arrival))
        good += all(bound is None or value * 1000 <= bound for bound, value in checks)
    return good / duration_s
