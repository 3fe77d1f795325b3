"""What one step does and may spend: ``StepPlan`` (the scheduler's output, executed
verbatim), ``StepBudget`` (what the stages spend as they plan), and the chunk rule."""

from __future__ import annotations

from dataclasses import dataclass, field

from superinfer_jax.config import BucketLimits, EngineConfig
from superinfer_jax.kv.two_tier import PageMoves

HOST = "host"  # an evicted request's KV goes to the host tier (rotation)
RECOMPUTE = "recompute"  # an evicted request's KV is dropped and recomputed later


@dataclass(slots=True)
class StepBudget:
    """What one step may still take: ``tokens`` (decode rows and prefill chunks),
    ``prefill_slots`` (padded slots of the prefill call), ``pages_out`` / ``pages_in``
    (page copies each way for policy-chosen rotations) and ``limits`` (the call shapes
    compiled so far: a step never compiles)."""

    tokens: int
    prefill_slots: int
    pages_out: int
    pages_in: int
    limits: BucketLimits

    def __init__(self, tokens: int, prefill_slots: int, pages_out: int, pages_in: int,
                 limits: BucketLimits) -> None:  # written out: ``NATIVE_INIT``
        self.tokens = tokens
        self.prefill_slots = prefill_slots
        self.pages_out = pages_out
        self.pages_in = pages_in
        self.limits = limits

    @classmethod
    def full(cls, config: EngineConfig, limits: BucketLimits | None = None) -> StepBudget:
        """The configured budget: ``max_num_batched_tokens`` and ``transfer_budget_pages``,
        within ``limits`` (default: every bucket compiled)."""
        tokens, pages = config.engine.max_num_batched_tokens, config.duplex_kv.transfer_budget_pages
        # the class by name, not ``cls``: compiled, ``cls(...)`` is a generic call
        return StepBudget(tokens, tokens, pages, pages, limits or config.bucket_limits)

    def copy(self) -> StepBudget:
        return StepBudget(self.tokens, self.prefill_slots, self.pages_out, self.pages_in,
                          self.limits)


@dataclass
class StepPlan:
    """One step's work, as host ints. The engine executes it verbatim."""

    prefill: list[tuple[str, int]] = field(default_factory=list)  # (req_id, new tokens)
    decode: list[str] = field(default_factory=list)  # req_ids taking exactly one token
    preempted: list[str] = field(default_factory=list)  # freed now, recomputed later
    rotate_out: list[str] = field(default_factory=list)  # req_ids parked on the host
    rotate_in: list[str] = field(default_factory=list)  # req_ids brought back
    moves_out: list[PageMoves] = field(default_factory=list)  # device -> host page copies
    moves_in: list[PageMoves] = field(default_factory=list)  # host -> device page copies
    host_hits: list[str] = field(default_factory=list)  # admitted by a host-tier prefix hit
    shadows: list[PageMoves] = field(default_factory=list)  # eager shadows, device -> host
    budget: StepBudget | None = None  # tokens and slots granted, before the rows spent them

    def __init__(self, prefill: list[tuple[str, int]] | None = None,
                 decode: list[str] | None = None, preempted: list[str] | None = None,
                 rotate_out: list[str] | None = None, rotate_in: list[str] | None = None,
                 moves_out: list[PageMoves] | None = None,
                 moves_in: list[PageMoves] | None = None, host_hits: list[str] | None = None,
                 shadows: list[PageMoves] | None = None,
                 budget: StepBudget | None = None) -> None:  # written out: ``NATIVE_INIT``
        self.prefill = [] if prefill is None else prefill
        self.decode = [] if decode is None else decode
        self.preempted = [] if preempted is None else preempted
        self.rotate_out = [] if rotate_out is None else rotate_out
        self.rotate_in = [] if rotate_in is None else rotate_in
        self.moves_out = [] if moves_out is None else moves_out
        self.moves_in = [] if moves_in is None else moves_in
        self.host_hits = [] if host_hits is None else host_hits
        self.shadows = [] if shadows is None else shadows
        self.budget = budget

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.decode

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(n for _, n in self.prefill)


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The cached prefix of a waiting request: shared device pages, then the cache-only
    host pages that follow them (rotated in before the rest is prefilled)."""

    device: tuple[int, ...] = ()
    host: tuple[int, ...] = ()
    # the prefix continues in pages on their way in: waiting beats prefilling them again
    arriving: bool = False

    @property
    def num_pages(self) -> int:
        return len(self.device) + len(self.host)


NO_HIT = PrefixHit()


def next_chunk(pending: int, limit: int) -> int:
    """The chunk rule for ``pending`` tokens: 1 when decoding, else up to ``limit`` (0:
    nothing left, its token in flight ends it)."""
    return 1 if pending == 1 else min(pending, limit)
