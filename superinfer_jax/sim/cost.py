"""What the simulator asks a cost model: the two model calls of a step, and page copies.

The engine runs one step as a prefill call (``[rows, chunk]``, padded to a bucket) and a
decode call (``[rows, 1]``, padded to a bucket), dispatched back to back; the prefill
rows' tokens are read when the first call ends, the decode rows' when the second ends.
A cost model therefore prices each call apart (``CallShape``), and page copies per
direction (``transfer_s``).

Two implementations:

- ``RooflineCost``: a model preset on a hardware preset (``cost_model``), from bytes and
  FLOPs; padded rows and columns cost FLOPs, as they do in the engine's compiled step.
- ``CalibratedCost``: this machine, from the engine's own profiled ``LatencyModel``
  (``profiler.profile_engine``), priced at the padded bucket shapes the profile timed,
  plus a measured host overhead per step, per row and per page copied (what the
  profile leaves out: scheduling, building inputs, reading tokens back, and on a CPU
  the page copies, which run on the same cores as the model).

``latency_model_of(cost)`` turns any cost model into a ``LatencyModel`` (fitted on the
model's own predictions, as the profiler fits the engine's timings), which is what the
``rotasched`` policy's slack mode reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from superinfer_jax.config import EngineConfig, bucket
from superinfer_jax.sched.latency import LatencyModel
from superinfer_jax.sim.cost_model import (
    Hardware,
    ModelShape,
    StepWork,
    step_time,
    transfer_time,
)

TRANSFER_MODES = ("duplex", "simplex", "naive")


@dataclass
class CallShape:
    """One model call of a step, as counts: what a cost model prices (``__init__`` written
    out: ``NATIVE_INIT`` in mypyc_build)."""

    num_rows: int  # real rows (requests)
    max_query: int  # longest row: 1 for decode, the longest chunk for prefill
    num_tokens: int  # query tokens over all rows
    kv_tokens_read: int  # context each row attends to (after this call), summed
    attn_pairs: int  # (query, key) pairs over all rows, causal
    max_context: int  # longest context (after this call) in the call

    def __init__(self, num_rows: int, max_query: int, num_tokens: int, kv_tokens_read: int,
                 attn_pairs: int, max_context: int) -> None:
        self.num_rows = num_rows
        self.max_query = max_query
        self.num_tokens = num_tokens
        self.kv_tokens_read = kv_tokens_read
        self.attn_pairs = attn_pairs
        self.max_context = max_context

    @staticmethod
    def of_rows(rows: list[tuple[int, int]]) -> CallShape:
        """From ``(new tokens, context before)`` per row (at least one)."""
        if not rows:
            raise ValueError("a call has at least one row")
        max_query, num_tokens, kv_read, pairs, max_context = 0, 0, 0, 0, 0
        for n, p in rows:  # one pass, not five generators: a prefill call every step
            max_query = max(max_query, n)
            num_tokens += n
            kv_read += n + p
            pairs += n * p + n * (n + 1) // 2
            max_context = max(max_context, n + p)
        return CallShape(len(rows), max_query, num_tokens, kv_read, pairs, max_context)


class CostModel(Protocol):
    """Seconds for the simulator's events. Implementations must be monotone in every
    count (more work is never faster), like the engine's latency model."""

    @property
    def page_bytes(self) -> int:
        """Bytes of one KV page (all layers, K and V)."""
        ...

    def prefill_call_s(self, shape: CallShape) -> float: ...

    def decode_call_s(self, shape: CallShape) -> float: ...

    def host_s(self, num_rows: int, num_pages: int) -> float:
        """Host time of a step before its calls run (scheduling, inputs, dispatch, and
        issuing ``num_pages`` page copies)."""
        ...

    def transfer_s(self, num_pages: int, duplex: bool) -> float:
        """One batch of ``num_pages`` page copies in one direction; ``duplex``: the other
        direction is busy meanwhile."""
        ...

    @property
    def overlaps_directions(self) -> bool:
        """Whether copies in the two directions run at the same time (else they queue)."""
        ...

    @property
    def name(self) -> str: ...


@dataclass(frozen=True)
class RooflineCost:
    """A model preset on a hardware preset. ``pad``: price FLOPs at the engine's padded
    bucket shapes (True, what this engine does) or at the real token counts (a ragged
    engine such as vLLM). ``transfer_mode``: ``duplex`` (DuplexKV: batched whole-page
    copies, both directions at once), ``simplex`` (batched, but the directions do not
    overlap, so each runs at the one-way rate in turn) or ``naive`` (one synchronous copy
    per layer plane, no overlap)."""

    model: ModelShape
    hw: Hardware
    config: EngineConfig
    pad: bool = True
    transfer_mode: str = "duplex"

    def __post_init__(self) -> None:
        if self.transfer_mode not in TRANSFER_MODES:
            raise ValueError(f"transfer_mode must be one of {TRANSFER_MODES}, "
                             f"got {self.transfer_mode!r}")

    @property
    def name(self) -> str:
        return f"roofline:{self.model.name}@{self.hw.name}"

    @property
    def page_bytes(self) -> int:
        return self.model.page_bytes(self.config.hardware.page_size)

    def prefill_call_s(self, shape: CallShape) -> float:
        tokens = shape.num_tokens
        if self.pad:
            tokens = (bucket(shape.num_rows, self.config.prefill_row_buckets)
                      * bucket(shape.max_query, self.config.prefill_chunk_buckets))
        return step_time(self.model, self.hw,
                         StepWork(tokens, shape.kv_tokens_read, shape.attn_pairs))

    def decode_call_s(self, shape: CallShape) -> float:
        """Rows padded to a bucket (``pad``); a row's speculative tokens beyond its first
        (``num_tokens - num_rows``) are priced ragged."""
        rows = bucket(shape.num_rows, self.config.decode_buckets) if self.pad \
            else shape.num_rows
        tokens = rows + shape.num_tokens - shape.num_rows
        return step_time(self.model, self.hw,
                         StepWork(tokens, shape.kv_tokens_read, shape.attn_pairs))

    def host_s(self, num_rows: int, num_pages: int) -> float:
        return 0.0  # in ``hw.step_overhead_s`` of each call; DMA engines copy pages

    def transfer_s(self, num_pages: int, duplex: bool) -> float:
        if num_pages <= 0:
            return 0.0
        num_bytes = num_pages * self.page_bytes
        if self.transfer_mode == "naive":
            copies = num_pages * 2 * self.model.num_layers
            return transfer_time(self.hw, num_bytes, copies, duplex=False)
        return transfer_time(self.hw, num_bytes, num_pages,
                             duplex=duplex and self.transfer_mode == "duplex", batched=True)

    @property
    def overlaps_directions(self) -> bool:
        return self.transfer_mode == "duplex"


@dataclass(frozen=True)
class HostOverhead:
    """Engine host time a profile of the compiled calls does not see (seconds)."""

    per_step_s: float = 0.0  # scheduling, building inputs, dispatch
    per_row_s: float = 0.0  # per request row: padding its inputs, reading its token back
    per_page_s: float = 0.0  # per page copied: on a CPU the copies share the cores


@dataclass(frozen=True)
class CalibratedCost:
    """This machine, from the engine's profile of its compiled buckets: a call is priced
    at its padded shape with every row at the longest context (the engine's attention
    walks every row that far, and padded rows compute like real ones)."""

    latency: LatencyModel
    config: EngineConfig
    page_bytes: int
    host: HostOverhead = HostOverhead()

    @property
    def name(self) -> str:
        return f"calibrated:{self.latency.model_name or 'model'}@{self.latency.machine}"

    def prefill_call_s(self, shape: CallShape) -> float:
        rows = bucket(shape.num_rows, self.config.prefill_row_buckets)
        cols = bucket(shape.max_query, self.config.prefill_chunk_buckets)
        p0, p1, p2 = self.latency.prefill
        past = max(0, shape.max_context - cols)  # every row walks the longest context
        return p0 + rows * (p1 * cols + p2 * cols * past)

    def decode_call_s(self, shape: CallShape) -> float:
        """Speculative tokens beyond a row's first each cost what a padded row costs."""
        rows = bucket(shape.num_rows, self.config.decode_buckets) + shape.num_tokens \
            - shape.num_rows
        return self.latency.decode_s(rows, rows * shape.max_context)

    def host_s(self, num_rows: int, num_pages: int) -> float:
        h = self.host
        return h.per_step_s + h.per_row_s * num_rows + h.per_page_s * num_pages

    def transfer_s(self, num_pages: int, duplex: bool) -> float:
        return self.latency.transfer_s(num_pages * self.page_bytes) if num_pages > 0 else 0.0

    @property
    def overlaps_directions(self) -> bool:
        return False  # both directions are memcpys on the same CPU cores


def latency_model_of(cost: CostModel, config: EngineConfig, name: str = "") -> LatencyModel:
    """A ``LatencyModel`` fitted on ``cost``'s own predictions, over the shapes the
    profiler times (so the slack policy sees the simulated machine, not this one)."""
    if isinstance(cost, CalibratedCost):
        return cost.latency
    max_ctx = config.model.max_model_len - 1
    contexts = sorted({min(c, max_ctx) for c in (16, max_ctx // 4, max_ctx)})
    decode = [(b, b * c, cost.decode_call_s(CallShape.of_rows([(1, c - 1)] * b)))
              for b in config.decode_buckets for c in contexts]
    prefill = []
    for chunk in config.prefill_chunk_buckets:
        for past in sorted({0, max(0, min(max_ctx, chunk + max_ctx // 2) - chunk)}):
            prefill.append((chunk, past, cost.prefill_call_s(CallShape.of_rows([(chunk, past)]))))
    transfer = [(n * cost.page_bytes, cost.transfer_s(n, duplex=False)) for n in (1, 8, 32)]
    return LatencyModel.fit(prefill, decode, transfer, model_name=name or cost.name)


@dataclass(frozen=True)
class ConstantCost:
    """Fixed seconds per call and per copied page: timelines computable by hand (tests,
    and a sanity baseline). ``overlap``: whether the two directions copy at once."""

    prefill_s: float
    decode_s: float
    page_s: float = 0.0
    page_bytes: int = 1
    overlap: bool = True

    @property
    def name(self) -> str:
        return f"constant:{self.prefill_s}/{self.decode_s}/{self.page_s}"

    def prefill_call_s(self, shape: CallShape) -> float:
        return self.prefill_s

    def decode_call_s(self, shape: CallShape) -> float:
        return self.decode_s

    def host_s(self, num_rows: int, num_pages: int) -> float:
        return 0.0

    def transfer_s(self, num_pages: int, duplex: bool) -> float:
        return self.page_s * num_pages

    @property
    def overlaps_directions(self) -> bool:
        return self.overlap
