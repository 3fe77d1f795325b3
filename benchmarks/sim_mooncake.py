"""Mooncake traces for the simulator at full scale: hash ids as prompt content.

``benchmarks.workloads.load_mooncake`` turns each 512-token hash block into real token
ids (scaled down, for the engine on a small machine). The simulator needs no tokens:
a ``RequestSpec`` carries the hash ids themselves (``hash_ids``, ``block_tokens`` 512)
and the simulator derives page hashes from them, so prompts keep their recorded lengths
(mean about 12k tokens on the conversation trace) and share exactly the prefixes their
ids share, which is what prefix caching is measured on.

Arrivals replay the trace's timestamps, scaled to a mean ``rate`` (requests per second
over the whole trace: the conversation trace records 3.4), so a rate sweep keeps the
trace's order and burstiness; the requests kept are the first ``num_requests``, or those
arriving within ``duration_s``. A prompt over ``max_prompt`` tokens keeps its first
``max_prompt`` (and the ids covering them), which keeps shared prefixes shared.

    from benchmarks.sim_mooncake import BlockTrace, load_block_trace
    specs, notes = load_block_trace(BlockTrace("mooncake_conv", rate=2.0,
                                               num_requests=3000, max_prompt=32767))
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from benchmarks.workloads import (
    MOONCAKE_BLOCK,
    TRACES,
    SLOClass,
    _mooncake_row,
    find_trace,
)
from superinfer_jax.request import SLO
from superinfer_jax.sim.simulator import RequestSpec

BLOCK_TRACES = ("mooncake_conv", "mooncake_synthetic")  # traces with hash_ids


def is_block_trace(dataset: str) -> bool:
    """A Mooncake trace by name, or a JSONL file whose first record has ``hash_ids``."""
    if dataset in BLOCK_TRACES:
        return True
    if dataset in TRACES or not (dataset.endswith(".jsonl") and os.path.isfile(dataset)):
        return False
    with open(dataset) as f:
        for line in f:
            if line.strip():
                try:
                    first = json.loads(line)
                except ValueError:
                    return False
                return isinstance(first, dict) and "hash_ids" in first
    return False


@dataclass(frozen=True)
class BlockTrace:
    """Which requests of a Mooncake trace to simulate, and how fast they arrive."""

    dataset: str = "mooncake_conv"
    rate: float | None = None  # mean requests/s; None: the timestamps as recorded
    num_requests: int | None = None  # the first ones (with duration_s: whichever is fewer)
    duration_s: float | None = None  # those arriving within this many seconds
    max_prompt: int = 32767
    max_output: int | None = None
    slo_mix: tuple[SLOClass, ...] = (SLOClass(1.0),)
    seed: int = 0  # draws each request's SLO class

    def __post_init__(self) -> None:
        for name in ("rate", "num_requests", "duration_s", "max_prompt", "max_output"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0, got {v!r}")
        if not self.slo_mix:
            raise ValueError("slo_mix needs at least one class")


def load_block_trace(spec: BlockTrace) -> tuple[list[RequestSpec], list[str]]:
    """The trace's requests as specs with hash ids, sorted by arrival, and notes for the
    log (how many were kept, truncated, the arrival scaling)."""
    path = find_trace(spec.dataset)
    rows = _rows(path)
    span = rows[-1][0] - rows[0][0]
    native = (len(rows) - 1) / span * 1000 if span > 0 else float("inf")
    scale = 1.0 if spec.rate is None or not np.isfinite(native) else native / spec.rate
    rng = np.random.default_rng(spec.seed)
    weights = np.array([c.weight for c in spec.slo_mix], np.float64)
    classes = rng.choice(len(spec.slo_mix), len(rows), p=weights / weights.sum())
    slos = [SLO(c.ttft_ms, c.tbt_ms, c.priority_class) for c in spec.slo_mix]
    out: list[RequestSpec] = []
    truncated = 0
    t0 = rows[0][0]
    for (ts, n_in, n_out, ids), c in zip(rows, classes, strict=True):
        arrival = (ts - t0) / 1000 * scale
        if spec.num_requests is not None and len(out) >= spec.num_requests:
            break
        if spec.duration_s is not None and arrival >= spec.duration_s:
            break
        n = min(n_in, spec.max_prompt)
        truncated += n < n_in
        o = max(1, n_out) if spec.max_output is None else min(max(1, n_out), spec.max_output)
        out.append(RequestSpec(arrival, n, o, slos[c],
                               hash_ids=tuple(ids[:-(-n // MOONCAKE_BLOCK)]),
                               block_tokens=MOONCAKE_BLOCK))
    if not out:
        raise ValueError(f"no request of {path!r} arrives within {spec.duration_s} s")
    prompt = np.array([s.prompt_len for s in out])
    rate = "as recorded" if spec.rate is None else f"scaled to {spec.rate:g} req/s"
    notes = [f"{spec.dataset}: {len(out)} of {len(rows)} requests (arrivals {rate}; the "
             f"trace records {native:.2f} req/s), prompts mean {prompt.mean():.0f} / max "
             f"{prompt.max()} tokens, {truncated} cut to {spec.max_prompt}"]
    return sorted(out, key=lambda s: s.arrival_s), notes


def _rows(path: str) -> list[tuple[float, int, int, list[int]]]:
    rows = []
    with open(path) as f:
        for i, line in enumerate(f, start=1):
            if line.strip():
                rows.append(_mooncake_row(path, i, line))
    if not rows:
        raise ValueError(f"trace {path!r} holds no requests")
    return rows
