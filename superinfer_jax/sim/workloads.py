"""Workloads for the simulator and the serving benchmark: request lengths, arrivals, SLOs.

Traces hold token counts only (no text): a request is (prompt_len, output_len), with the
prompt built from random token ids and the output forced to its length (EOS ignored).
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from superinfer_jax.sim.sharegpt import TokenizerLike

# Loads the tokenizer that counts ShareGPT tokens: (tokenizer, its name for the length cache)
TokenizerLoader = Callable[[], tuple[TokenizerLike, str]]

# The vendored traces (sources and licences in its README.md), found by name in a source
# checkout; an installed package takes a trace by its path.
TRACE_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "traces"
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
    path = TRACE_DIR / TRACES[name_or_path]
    if not path.is_file():
        raise ValueError(f"trace {name_or_path!r} not found at {path} (names resolve in a "
                         f"source checkout; elsewhere give the file's path)")
    return str(path)


def load_trace(name_or_path: str, limit: int | None = None) -> list[TraceRequest]:
    path = find_trace(name_or_path)
    rows = _read_csv(path, limit) if path.endswith(".csv") else _read_jsonl(path, limit)
    if not rows:
        raise ValueError(f"trace {path!r} holds no requests")
    return rows


def _read_csv(path: str, limit: int | None) -> list[TraceRequest]:
    from datetime import datetime

    out: list[TraceRequest] = []
    t0: float | None = None
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
    out: list[TraceRequest] = []
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


# -- workloads for the serving benchmark and the simulator ------------------------------

DATASETS = ("sharegpt", "random", *TRACES)
ARRIVALS = ("poisson", "gamma", "trace")


@dataclass(frozen=True)
class SLOClass:
    """One class of a workload's SLO / priority mix, drawn with probability ``weight``."""

    weight: float
    ttft_ms: float = 5000.0
    tbt_ms: float = 100.0
    priority_class: str = "standard"


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a workload: when it is sent, its lengths, its SLO, and its prompt
    text when the dataset has one (ShareGPT) or its token ids when the workload fixes
    them; otherwise the client sends ``prompt_len`` random token ids."""

    arrival_s: float  # offset from the start of the run
    prompt_len: int  # tokens (by the workload's tokenizer for text prompts)
    output_len: int  # tokens to generate (max_tokens, EOS ignored)
    ttft_ms: float
    tbt_ms: float
    priority_class: str = "standard"
    prompt: str | None = None
    # Exact prompt token ids, when the workload fixes them (multi-turn conversations,
    # Mooncake hash blocks): sent as ids, never re-tokenized, so shared prefixes stay
    # shared token for token. ``cache_salt``: the prefix-cache isolation key to send (a
    # fresh one per run keeps one run from hitting pages an earlier run left behind).
    prompt_ids: tuple[int, ...] | None = None
    cache_salt: str | None = None


@dataclass(frozen=True)
class WorkloadSpec:
    """Everything that makes a workload, so a run is reproducible from it and its seed.

    Lengths: ``dataset`` is ``sharegpt`` (first turns of real conversations, tokenized),
    ``random`` (uniform around ``random_input_len`` / ``random_output_len`` within
    ``random_range_ratio``, as vLLM's random dataset), a trace name or a trace file.
    Requests longer than ``max_prompt`` / ``max_total`` tokens are dropped (after
    ``length_scale``), as vLLM's ShareGPT sampling drops them.

    Arrivals: ``poisson`` at ``rate`` requests/s, ``gamma`` with ``burstiness`` (the
    shape: < 1 is burstier than Poisson), or ``trace``: the trace's own timestamps divided
    by ``time_scale`` (2 replays twice as fast). ``rate`` inf sends everything at once.
    ``duration_s`` (with poisson/gamma): as many requests as arrive in that window
    (the paper's runs: 120 s), instead of ``num_requests``.
    """

    dataset: str = "sharegpt"
    num_requests: int = 200
    rate: float = 1.0
    arrival: str = "poisson"
    burstiness: float = 1.0
    time_scale: float = 1.0
    duration_s: float | None = None
    random_input_len: int = 256
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    max_prompt: int = 1024
    max_total: int = 2048
    min_len: int = 4
    length_scale: float = 1.0
    slo_mix: tuple[SLOClass, ...] = (SLOClass(1.0),)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS and not os.path.isfile(self.dataset):
            raise ValueError(f"dataset must be one of {list(DATASETS)} or a trace file, "
                             f"got {self.dataset!r}")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {list(ARRIVALS)}, got {self.arrival!r}")
        if self.arrival == "trace" and self.dataset in ("sharegpt", "random"):
            raise ValueError(f"arrival 'trace' needs a trace dataset, not {self.dataset!r}")
        _check_positive("num_requests", self.num_requests, integer=True)
        for name in ("rate", "burstiness", "time_scale", "length_scale"):
            _check_positive(name, getattr(self, name))
        if self.duration_s is not None:
            _check_positive("duration_s", self.duration_s)
            if self.rate == float("inf"):
                raise ValueError("duration_s needs a finite rate")
        for name in ("random_input_len", "random_output_len", "max_prompt", "max_total",
                     "min_len"):
            _check_positive(name, getattr(self, name), integer=True)
        if not 0 <= self.random_range_ratio < 1:
            raise ValueError(f"random_range_ratio must be in [0, 1), got "
                             f"{self.random_range_ratio}")
        if not self.slo_mix or any(c.weight <= 0 for c in self.slo_mix):
            raise ValueError("slo_mix needs at least one class, each with weight > 0")


def _check_positive(name: str, value: object, integer: bool = False) -> None:
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not value > 0 \
            or value != value:
        raise ValueError(f"{name} must be a positive {'int' if integer else 'number'}, "
                         f"got {value!r}")


def parse_slo_mix(text: str) -> tuple[SLOClass, ...]:
    """``"0.2:critical:2000:50,0.8:standard:5000:100"`` -> classes (weight:class:ttft:tbt).
    A bare ``ttft:tbt`` is one standard class."""
    out = []
    for part in (p for p in text.split(",") if p.strip()):
        fields = part.strip().split(":")
        try:
            if len(fields) == 2:
                out.append(SLOClass(1.0, float(fields[0]), float(fields[1])))
            elif len(fields) == 4:
                out.append(SLOClass(float(fields[0]), float(fields[2]), float(fields[3]),
                                    fields[1]))
            else:
                raise ValueError("expected weight:class:ttft_ms:tbt_ms or ttft_ms:tbt_ms")
        except ValueError as e:
            raise ValueError(f"bad SLO class {part!r}: {e}") from e
    from superinfer_jax.request import SLO

    for c in out:
        SLO(c.ttft_ms, c.tbt_ms, c.priority_class)  # validates, with the engine's messages
        if c.weight <= 0:
            raise ValueError(f"SLO class weight must be > 0, got {c.weight}")
    if not out:
        raise ValueError(f"no SLO class in {text!r}")
    return tuple(out)


@dataclass(frozen=True)
class _Lengths:
    prompt_len: int
    output_len: int
    timestamp_s: float = 0.0
    prompt: str | None = None


def build_workload(spec: WorkloadSpec, tokenizer=None, report: list[str] | None = None,
                   load_tokenizer: TokenizerLoader | None = None) -> list[WorkloadRequest]:
    """The requests of ``spec``, sorted by arrival. ``report`` collects one-line notes
    (records recovered, requests dropped) for the run's log and JSON. ShareGPT lengths
    are counted by ``tokenizer``, else by ``load_tokenizer()``'s (called only for
    ShareGPT; ``serving.bench.sharegpt.default_tokenizer`` loads SmolLM2's)."""
    notes = report if report is not None else []
    rng = np.random.default_rng(spec.seed)
    pool = _length_pool(spec, tokenizer, load_tokenizer, rng, notes)
    if spec.arrival == "trace":
        rows = pool[: spec.num_requests]
        t0 = rows[0].timestamp_s
        arrivals = np.array([(r.timestamp_s - t0) / spec.time_scale for r in rows])
    else:
        arrivals = _arrivals(spec, rng)
        idx = rng.choice(len(pool), len(arrivals), replace=len(arrivals) > len(pool))
        rows = [pool[i] for i in idx]
    classes = rng.choice(len(spec.slo_mix), len(rows),
                         p=_weights([c.weight for c in spec.slo_mix]))
    out = [WorkloadRequest(float(a), r.prompt_len, r.output_len, spec.slo_mix[c].ttft_ms,
                           spec.slo_mix[c].tbt_ms, spec.slo_mix[c].priority_class, r.prompt)
           for a, r, c in zip(arrivals, rows, classes, strict=True)]
    return sorted(out, key=lambda r: r.arrival_s)


def _weights(w: list[float]) -> np.ndarray:
    a = np.asarray(w, np.float64)
    return a / a.sum()


def _arrivals(spec: WorkloadSpec, rng: np.random.Generator) -> np.ndarray:
    shape = 1.0 if spec.arrival == "poisson" else spec.burstiness
    if spec.rate == float("inf"):
        return np.zeros(spec.num_requests)
    if spec.duration_s is None:
        return poisson_arrivals(spec.num_requests, spec.rate, rng, shape)
    n = int(spec.rate * spec.duration_s * 1.5) + 16
    t = poisson_arrivals(n, spec.rate, rng, shape)
    while t[-1] < spec.duration_s:
        n *= 2
        t = poisson_arrivals(n, spec.rate, rng, shape)
    return t[t < spec.duration_s]


def _length_pool(spec: WorkloadSpec, tokenizer, load_tokenizer: TokenizerLoader | None,
                 rng: np.random.Generator, notes: list[str]) -> list[_Lengths]:
    if spec.dataset == "random":
        return _random_lengths(spec, rng)
    if spec.dataset == "sharegpt":
        raw = _sharegpt_lengths(tokenizer, load_tokenizer, notes)
    else:
        raw = [_Lengths(r.prompt_len, r.output_len, r.timestamp_s)
               for r in load_trace(spec.dataset)]
    kept = [_scaled(r, spec.length_scale) for r in raw]
    low = spec.min_len if spec.dataset == "sharegpt" else 1  # vLLM's ShareGPT rule only
    kept = [r for r in kept if low <= r.prompt_len <= spec.max_prompt and r.output_len >= low
            and r.prompt_len + r.output_len <= spec.max_total]
    notes.append(f"{spec.dataset}: {len(kept)} of {len(raw)} requests fit (prompt <= "
                 f"{spec.max_prompt}, total <= {spec.max_total} tokens)")
    if not kept:
        raise ValueError(f"no request of {spec.dataset!r} fits max_prompt {spec.max_prompt} "
                         f"and max_total {spec.max_total}")
    return kept


def _scaled(r: _Lengths, scale: float) -> _Lengths:
    if scale == 1.0:
        return r
    return _Lengths(max(1, round(r.prompt_len * scale)), max(1, round(r.output_len * scale)),
                    r.timestamp_s, None if r.prompt is None else r.prompt)


def _random_lengths(spec: WorkloadSpec, rng: np.random.Generator) -> list[_Lengths]:
    def draw(mean: int, n: int) -> np.ndarray:
        lo = max(1, int(mean * (1 - spec.random_range_ratio)))
        hi = max(lo, int(mean * (1 + spec.random_range_ratio)))
        return rng.integers(lo, hi + 1, n)

    n = spec.num_requests if spec.duration_s is None else \
        int(spec.rate * spec.duration_s * 2) + 16
    return [_Lengths(int(p), int(o)) for p, o in zip(draw(spec.random_input_len, n),
                                                    draw(spec.random_output_len, n),
                                                    strict=True)]


def _sharegpt_lengths(tokenizer, load_tokenizer: TokenizerLoader | None,
                      notes: list[str]) -> list[_Lengths]:
    from superinfer_jax.sim.sharegpt import tokenized_first_turns

    if tokenizer is None:
        if load_tokenizer is None:
            raise ValueError("the sharegpt dataset counts tokens: give a tokenizer or "
                             "load_tokenizer")
        tokenizer, name = load_tokenizer()
    else:
        name = getattr(tokenizer, "name", None) or type(tokenizer).__name__
    reqs, report = tokenized_first_turns(tokenizer, name)
    notes.append(f"sharegpt: {report.describe()}; {len(reqs)} conversations with a "
                 f"prompt and a reply")
    return [_Lengths(r.prompt_len, r.output_len, 0.0, r.prompt) for r in reqs]
