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
    text when the dataset has one (ShareGPT); otherwise the client sends ``prompt_len``
    random token ids."""

    arrival_s: float  # offset from the start of the run
    prompt_len: int  # tokens (by the workload's tokenizer for text prompts)
    output_len: int  # tokens to generate (max_tokens, EOS ignored)
    ttft_ms: float
    tbt_ms: float
    priority_class: str = "standard"
    prompt: str | None = None


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


def build_workload(spec: WorkloadSpec, tokenizer=None, report: list[str] | None = None
                   ) -> list[WorkloadRequest]:
    """The requests of ``spec``, sorted by arrival. ``report`` collects one-line notes
    (records recovered, requests dropped) for the run's log and JSON."""
    notes = report if report is not None else []
    rng = np.random.default_rng(spec.seed)
    pool = _length_pool(spec, tokenizer, rng, notes)
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


def _length_pool(spec: WorkloadSpec, tokenizer, rng: np.random.Generator,
                 notes: list[str]) -> list[_Lengths]:
    if spec.dataset == "random":
        return _random_lengths(spec, rng)
    if spec.dataset == "sharegpt":
        raw = _sharegpt_lengths(tokenizer, notes)
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


def _sharegpt_lengths(tokenizer, notes: list[str]) -> list[_Lengths]:
    from benchmarks.sharegpt import default_tokenizer, tokenized_first_turns

    if tokenizer is None:
        tokenizer, name = default_tokenizer()
    else:
        name = getattr(tokenizer, "name", None) or type(tokenizer).__name__
    reqs, report = tokenized_first_turns(tokenizer, name)
    notes.append(f"sharegpt: {report.describe()}; {len(reqs)} conversations with a "
                 f"prompt and a reply")
    return [_Lengths(r.prompt_len, r.output_len, 0.0, r.prompt) for r in reqs]


# -- Mooncake traces as token ids: shareable prefix blocks ------------------------------

MOONCAKE_BLOCK = 512  # tokens per hash id in the Mooncake traces
_ID_DIGITS = 4  # leading tokens of a block spell its hash id: distinct ids, distinct blocks


@dataclass(frozen=True)
class BlockRequest:
    """One Mooncake request as token ids. ``prompt`` is the blocks of ``hash_ids`` laid end
    to end (the last one truncated to the scaled input length), so two requests share
    exactly the prompt prefix their hash ids share."""

    arrival_s: float  # (timestamp - first timestamp) * slowdown, in seconds
    prompt: tuple[int, ...]
    output_len: int
    hash_ids: tuple[int, ...]
    line: int  # 1-based line of the trace file


def hash_block(hash_id: int, block_tokens: int, vocab_size: int, low_token: int = 1,
               seed: int = 0) -> np.ndarray:
    """The fixed token block of one hash id: ``block_tokens`` ids in [low_token, vocab).

    The first ``min(4, block_tokens)`` tokens spell ``hash_id`` in base
    ``vocab_size - low_token`` (so different ids below base**4 give different blocks,
    not just very probably different ones); the rest are drawn by an RNG seeded with
    (``seed``, ``hash_id``). Equal ids (and seeds) always give identical blocks."""
    base = vocab_size - low_token
    if base < 2 or low_token < 0 or block_tokens < 1 or hash_id < 0:
        raise ValueError(f"need 0 <= low_token < vocab_size - 1, block_tokens >= 1 and a "
                         f"hash id >= 0, got {low_token}, {vocab_size}, {block_tokens}, "
                         f"{hash_id}")
    out = np.random.default_rng([seed, hash_id]).integers(low_token, vocab_size,
                                                           block_tokens)
    x = hash_id
    for i in range(min(_ID_DIGITS, block_tokens)):
        out[i] = low_token + x % base
        x //= base
    return out


def load_mooncake(name_or_path: str, block_tokens: int = 16, vocab_size: int = 256,
                  low_token: int = 1, limit: int | None = None, slowdown: float = 1.0,
                  max_prompt: int | None = None, max_output: int | None = None,
                  seed: int = 0) -> list[BlockRequest]:
    """A Mooncake trace (``mooncake_conv``, ``mooncake_synthetic`` or a path) as token ids,
    scaled to a small machine.

    Scaling: each 512-token hash block becomes ``block_tokens`` tokens (``hash_block``),
    so lengths shrink by ``block_tokens / 512``: the input length becomes
    ``ceil(input_length * block_tokens / 512)`` (every hash id keeps at least one token;
    the last block is truncated to it), the output length
    ``max(1, round(output_length * block_tokens / 512))``, clipped to ``max_output``.
    ``max_prompt`` keeps a prompt's first tokens (and the hash ids they cover), which
    keeps shared prefixes shared. Arrivals replay the timestamps (ms) times ``slowdown``
    (2: twice as slow). A line without a well-formed ``hash_ids`` (a list of
    ``ceil(input_length / 512)`` non-negative ints) is a ValueError naming the file and line.
    """
    if not slowdown > 0:
        raise ValueError(f"slowdown must be > 0, got {slowdown}")
    path = find_trace(name_or_path)
    scale = block_tokens / MOONCAKE_BLOCK
    blocks: dict[int, np.ndarray] = {}
    out: list[BlockRequest] = []
    t0: float | None = None
    with open(path) as f:
        for i, line in enumerate(f, start=1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            ts, n_in, n_out, ids = _mooncake_row(path, i, line)
            t0 = ts if t0 is None else t0
            n_tok = -(-n_in * block_tokens // MOONCAKE_BLOCK)
            if max_prompt is not None:
                n_tok = min(n_tok, max_prompt)
            ids = ids[: -(-n_tok // block_tokens)]
            for h in ids:
                if h not in blocks:
                    blocks[h] = hash_block(h, block_tokens, vocab_size, low_token, seed)
            prompt = np.concatenate([blocks[h] for h in ids])[:n_tok]
            o = max(1, round(n_out * scale))
            out.append(BlockRequest((ts - t0) / 1000 * slowdown,
                                    tuple(int(t) for t in prompt),
                                    min(o, max_output) if max_output else o, tuple(ids), i))
    if not out:
        raise ValueError(f"trace {path!r} holds no requests")
    return out


def _mooncake_row(path: str, i: int, line: str) -> tuple[float, int, int, list[int]]:
    where = f"trace {path!r} line {i}"
    try:
        r = json.loads(line)
    except ValueError as e:
        raise ValueError(f"{where}: not JSON ({e})") from e
    if not isinstance(r, dict):
        raise ValueError(f"{where}: expected an object, got {type(r).__name__}")
    for key in ("timestamp", "input_length", "output_length", "hash_ids"):
        if key not in r:
            raise ValueError(f"{where}: missing {key!r}")
    ts, n_in, n_out, ids = r["timestamp"], r["input_length"], r["output_length"], r["hash_ids"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not ts == ts:
        raise ValueError(f"{where}: timestamp must be a number, got {ts!r}")
    for key, v, low in (("input_length", n_in, 1), ("output_length", n_out, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{where}: {key} must be an int >= {low}, got {v!r}")
    want = -(-n_in // MOONCAKE_BLOCK)
    if not isinstance(ids, list) or len(ids) != want or any(
            isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in ids):
        raise ValueError(f"{where}: hash_ids must be a list of {want} non-negative ints "
                         f"(one per {MOONCAKE_BLOCK}-token block of input_length {n_in}), "
                         f"got {str(ids)[:80]}")
    return float(ts), n_in, n_out, ids
