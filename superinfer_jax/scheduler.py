"""Who runs this step: continuous batching with chunked prefill under a token budget.

The scheduler is pure host code over ``Request`` objects and the page seam of
``KVCacheManager``. It returns a ``StepPlan`` (data); the engine executes it and reports
back through ``on_step_done``. This is the vLLM V1 baseline: first come, first served;
when a running request needs a page and none is free, the most recently admitted running
request is preempted (its pages freed, to be recomputed later). The RotaSched policies
plug in at the same seam.

Rotation (DuplexKV) seam: a policy rotates a running request out with ``_rotate_out``
(``TwoTierKVManager.rotate_out`` frees its device pages now; the plan carries the page
copies) and a parked one back in with ``_rotate_in``. Requests in flight or parked sit in
``rotary`` and are never scheduled; the engine reports finished copies through
``on_rotated_out`` / ``on_rotated_in`` / ``on_rotation_failed``. FCFS itself never
decides to rotate: it brings parked requests back first, and ``force_rotate_out`` is a
test-only hook that rotates the named running requests at the next ``schedule``. Without
room on the host (or without a host tier) a rotation falls back to recomputation.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from superinfer_jax.config import EngineConfig, bucket
from superinfer_jax.kv.page_allocator import KVCacheManager
from superinfer_jax.kv.two_tier import PageMoves, TwoTierKVManager
from superinfer_jax.request import Request, RequestStatus


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

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.decode

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(n for _, n in self.prefill)


class FCFSScheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the tail is preempted first
        self.rotary: list[Request] = []  # ROTATING_OUT, ROTARY, ROTATING_IN; oldest first
        self.force_rotate_out: set[str] = set()  # test hook: rotate these out next step
        self.page_bytes = 0  # bytes of one page (set by the engine), for cost predictions
        self.prefill_slots = config.max_num_batched_tokens  # padded prefill size, this step

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.rotary)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Drop a finished or aborted request and free its pages."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req in self.rotary:
            self.rotary.remove(req)
        self.force_rotate_out.discard(req.req_id)
        self.kv.free(req.req_id)

    def schedule(self, now: float | None = None) -> StepPlan:
        now = time.perf_counter() if now is None else now
        plan = StepPlan()
        budget = self.prefill_slots = self.config.max_num_batched_tokens
        self._rotate_forced(plan, now)
        budget = self._schedule_running(plan, budget, now)
        if self._rotate_in_parked(plan, now):
            self._admit_waiting(plan, budget, now)
        return plan

    def _schedule_running(self, plan: StepPlan, budget: int, now: float) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            pending = req.num_pending_tokens
            n = self._next_chunk(req, plan, budget)
            if n == 0:
                i += 1  # its token in flight ends it (async scheduling), or no prefill room
                continue
            if not self._reserve(req, n, plan, now):
                break  # req itself was preempted; everything after it already was
            if pending == 1:
                plan.decode.append(req.req_id)
            else:
                plan.prefill.append((req.req_id, n))
            budget -= n
            i += 1
        return budget

    def _next_chunk(self, req: Request, plan: StepPlan, budget: int) -> int:
        """Tokens ``req`` takes this step: 1 when decoding, else its next prefill chunk
        within the budget and the padded call (0: no room for another prefill row)."""
        pending = req.num_pending_tokens
        if pending == 1:
            return 1
        return min(pending, self._prefill_chunk_cap(plan), budget)

    def _prefill_chunk_cap(self, plan: StepPlan) -> int:
        """Longest chunk one more prefill row may take this step (0: no more rows).

        The prefill call is padded to ``[row bucket, column bucket]`` and a padded slot
        costs what a real token does, so the padded shape must fit in the step's token
        budget (``prefill_slots``), not only the real tokens: two rows of 200 tokens pad
        to 4x256 and ran 3.5x longer than one row of 256 (744 vs 211 ms on the CPU policy
        sweep), a stall for every decoder in the step."""
        cfg = self.config
        rows = len(plan.prefill) + 1
        if rows > cfg.max_prefill_rows:
            return 0
        row_bucket = bucket(rows, cfg.prefill_row_buckets)
        longest = max((n for _, n in plan.prefill), default=0)
        fits = [c for c in cfg.prefill_chunk_buckets
                if row_bucket * c <= self.prefill_slots and c >= longest]
        if fits:
            return fits[-1]
        return cfg.max_prefill_chunk if rows == 1 else 0  # one row always makes progress

    def _reserve(self, req: Request, n: int, plan: StepPlan, now: float) -> bool:
        """Pages for ``n`` more tokens of ``req``, preempting from the tail if needed."""
        total = req.num_computed_tokens + n
        while not self.kv.can_allocate(req.req_id, total):
            victim = self.running[-1]
            self._evict(victim, plan, now)
            if victim is req:
                return False
        self.kv.allocate_for(req.req_id, total)
        return True

    def _evict(self, req: Request, plan: StepPlan, now: float) -> None:
        """Make room by taking ``req`` off the device: FCFS (vLLM V1) recomputes it later."""
        self._preempt(req, plan, now)

    def _preempt(self, req: Request, plan: StepPlan, now: float) -> None:
        self.running.remove(req)
        self.kv.free(req.req_id)
        self._requeue_for_recompute(req, now)
        plan.preempted.append(req.req_id)
        plan.decode = [r for r in plan.decode if r != req.req_id]
        plan.prefill = [(r, n) for r, n in plan.prefill if r != req.req_id]

    # -- rotation --------------------------------------------------------------------------

    def _rotate_forced(self, plan: StepPlan, now: float) -> None:
        for req in [r for r in self.running if r.req_id in self.force_rotate_out]:
            self._rotate_out(req, plan, now)
        self.force_rotate_out.clear()  # requests not running now are not rotated

    def _rotate_out(self, req: Request, plan: StepPlan, now: float) -> None:
        """Park a running request on the host, or recompute it when the host has no room."""
        kv = self.kv
        if not isinstance(kv, TwoTierKVManager) or not kv.can_rotate_out(req.req_id):
            self._preempt(req, plan, now)
            return
        plan.moves_out.append(kv.rotate_out(req.req_id, req.num_computed_tokens))
        plan.rotate_out.append(req.req_id)
        self.running.remove(req)
        self.rotary.append(req)
        req.num_rotations += 1
        req.set_status(RequestStatus.ROTATING_OUT, now)

    def _rotate_in_parked(self, plan: StepPlan, now: float) -> bool:
        """Bring parked requests back, oldest first, within the transfer budget.

        Returns whether no request is left parked or on its way out: only then does FCFS
        admit new requests (the parked ones are older and go first)."""
        budget = self.config.transfer_budget_pages
        for req in [r for r in self.rotary if r.status == RequestStatus.ROTARY]:
            kv = self.kv
            assert isinstance(kv, TwoTierKVManager)
            cost = kv.rotation_cost_in(req.req_id)
            if self._num_seated() >= self.config.max_num_seqs \
                    or not kv.can_rotate_in(req.req_id) or (plan.rotate_in and cost > budget):
                return False
            self._rotate_in(req, plan, now)
            budget -= cost
        return all(r.status == RequestStatus.ROTATING_IN for r in self.rotary)

    def _rotate_in(self, req: Request, plan: StepPlan, now: float) -> None:
        """Bring a parked request back (device pages reserved now, runnable on arrival)."""
        assert isinstance(self.kv, TwoTierKVManager)
        plan.moves_in.append(self.kv.rotate_in(req.req_id))
        plan.rotate_in.append(req.req_id)
        req.set_status(RequestStatus.ROTATING_IN, now)

    def _num_seated(self) -> int:
        """Requests holding a batch row: running, or on their way back to running."""
        return len(self.running) + self._num_rotating_in()

    def _num_rotating_in(self) -> int:
        return sum(r.status == RequestStatus.ROTATING_IN for r in self.rotary)

    def on_rotated_out(self, req: Request, now: float) -> None:
        req.set_status(RequestStatus.ROTARY, now)

    def on_rotated_in(self, req: Request, now: float) -> None:
        self.rotary.remove(req)
        self.running.append(req)
        req.set_status(RequestStatus.RUNNING, now)

    def on_rotation_failed(self, req: Request, now: float) -> None:
        """A copy failed: drop both tiers' pages and recompute, never serve wrong KV."""
        self.rotary.remove(req)
        self.kv.free(req.req_id)
        self._requeue_for_recompute(req, now)

    def _requeue_for_recompute(self, req: Request, now: float) -> None:
        req.num_recomputed_tokens += req.num_computed_tokens
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.set_status(RequestStatus.WAITING, now)
        self.waiting.appendleft(req)

    # -- admission -----------------------------------------------------------------------

    def _admit_waiting(self, plan: StepPlan, budget: int, now: float) -> None:
        while self.waiting and budget > 0 and self._num_seated() < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.req_id in plan.preempted:
                break  # do not re-admit what this very step evicted
            n = self._admit_one(req, plan, budget, now)
            if not n:
                break  # FCFS: the head waits for memory, nobody overtakes it
            budget -= n

    def _admit_one(self, req: Request, plan: StepPlan, budget: int, now: float) -> int:
        """Admit waiting ``req`` for its first chunk if rows and pages allow; returns the
        tokens scheduled (0: not admitted)."""
        if req.num_inflight_tokens:
            return 0  # evicted while its last token was in flight: recompute once it lands
        n = self._next_chunk(req, plan, budget)
        if n == 0:
            return 0
        pending = req.num_pending_tokens
        if not self.kv.can_allocate(req.req_id, req.num_computed_tokens + n):
            return 0
        self.kv.allocate_for(req.req_id, req.num_computed_tokens + n)
        self.waiting.remove(req)
        self.running.append(req)
        req.set_status(RequestStatus.RUNNING, now)
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        if pending == 1:
            plan.decode.append(req.req_id)
        else:
            plan.prefill.append((req.req_id, n))
        return n
