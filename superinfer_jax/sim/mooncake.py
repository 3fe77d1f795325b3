"""Mooncake traces: requests whose prompts share the prefixes their hash ids share.

Each line of a Mooncake trace lists ``hash_ids``, one per 512-token block of its input:
equal ids are equal blocks. Two uses:

- For the engine on a small machine (``load_mooncake``, ``mooncake_workload``): each hash
  block becomes ``block_tokens`` fixed token ids (``hash_block``), so lengths scale down
  and requests share exactly the prefixes their ids share.
- For the simulator at full scale (``load_block_trace``): a ``RequestSpec`` carries the
  hash ids themselves (``hash_ids``, ``block_tokens`` 512) and the simulator derives page
  hashes from them, so prompts keep their recorded lengths (mean about 12k tokens on the
  conversation trace). Arrivals replay the trace's timestamps, scaled to a mean ``rate``
  (requests per second over the whole trace), so a rate sweep keeps the trace's order and
  burstiness; the requests kept are the first ``num_requests``, or those arriving within
  ``duration_s``. A prompt over ``max_prompt`` tokens keeps its first ``max_prompt`` (and
  the ids covering them), which keeps shared prefixes shared.

    from superinfer_jax.sim.mooncake import BlockTrace, load_block_trace
    specs, notes = load_block_trace(BlockTrace("mooncake_conv", rate=2.0,
                                               num_requests=3000, max_prompt=32767))
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from superinfer_jax.request import SLO
from superinfer_jax.sim.simulator import RequestSpec
from superinfer_jax.sim.workloads import (
    TRACES,
    SLOClass,
    WorkloadRequest,
    WorkloadSpec,
    _arrivals,
    _weights,
    find_trace,
)

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


# -- the serving benchmark: hash blocks as token ids -------------------------------------


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


# -- the simulator: hash ids as prompt content --------------------------------------------

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
