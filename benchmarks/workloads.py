"""Workloads for benchmarks and the simulator: request lengths from real traces, arrivals.

Traces hold token counts only (no text): a request is (prompt_len, output_len), with the
prompt built from random token ids and the output forced to its length (EOS ignored).
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass

import numpy as np

TRACE_DIR_CANDIDATES = ("../shared/traces", "shared/traces", "../../shared/traces")
TRACES = {
    "azure_conv": "azure_llm_2023_conv.csv",
    "azure_code": "azure_llm_2023_code.csv",
    "mooncake_conv": "mooncake_conversation.jsonl",
    "mooncake_synthetic": "mooncake_synthetic.jsonl",
}


@dataclass(frozen=True)
class TraceRequest:
    prompt_len: int
    output_len: int
    timestamp_s: float  # seconds from the trace's first request


def find_trace(name_or_path: str) -> str:
    if os.path.isfile(name_or_path):
        return name_or_path
    if name_or_path not in TRACES:
        raise ValueError(f"unknown trace {name_or_path!r}: give a file path or one of "
                         f"{sorted(TRACES)}")
    here = os.path.dirname(os.path.abspath(__file__))
    for base in TRACE_DIR_CANDIDATES:
        for root in (os.getcwd(), here):
            path = os.path.normpath(os.path.join(root, base, TRACES[name_or_path]))
            if os.path.isfile(path):
                return path
    raise ValueError(f"trace {name_or_path!r} not found (looked for {TRACES[name_or_path]} in "
                     f"../shared/traces)")


def load_trace(name_or_path: str, limit: int | None = None) -> list[TraceRequest]:
    path = find_trace(name_or_path)
    rows = _read_csv(path, limit) if path.endswith(".csv") else _read_jsonl(path, limit)
    if not rows:
        raise ValueError(f"trace {path!r} holds no requests")
    return rows


def _read_csv(path: str, limit: int | None) -> list[TraceRequest]:
    from datetime import datetime

    out, t0 = [], None
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"trace {path!r} lacks columns {sorted(missing)}")
        for i, row in enumerate(reader):
            if limit is not None and len(out) >= limit:
                break
            try:
                ts = datetime.fromisoformat(row["TIMESTAMP"][:26]).timestamp()
                p, o = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except (ValueError, TypeError) as e:
                raise ValueError(f"trace {path!r} line {i + 2}: {e}") from e
            t0 = ts if t0 is None else t0
            out.append(TraceRequest(max(1, p), max(1, o), ts - t0))
    return out


def _read_jsonl(path: str, limit: int | None) -> list[TraceRequest]:
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            if limit is not None and len(out) >= limit:
                break
            try:
                r = json.loads(line)
                out.append(TraceRequest(max(1, int(r["input_length"])),
                                        max(1, int(r["output_length"])),
                                        float(r["timestamp"]) / 1000))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"trace {path!r} line {i + 1}: {e}") from e
    return out


def scale_lengths(reqs: list[TraceRequest], max_prompt: int, max_output: int,
                  scale: float) -> list[TraceRequest]:
    """Shrink lengths by ``scale`` and clip, so a trace fits a small machine while keeping
    its shape (the ratio of long to short requests)."""
    return [TraceRequest(int(np.clip(round(r.prompt_len * scale), 1, max_prompt)),
                         int(np.clip(round(r.output_len * scale), 1, max_output)),
                         r.timestamp_s) for r in reqs]


def poisson_arrivals(n: int, rate: float, rng: np.random.Generator,
                     burstiness: float = 1.0) -> np.ndarray:
    """Arrival times (s) of a gamma process with mean rate ``rate`` (burstiness 1: Poisson)."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"rate and burstiness must be > 0, got {rate}, {burstiness}")
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    return np.cumsum(gaps) - gaps[0]
