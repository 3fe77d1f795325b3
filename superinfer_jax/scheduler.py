"""Who runs this step: continuous batching with chunked prefill under a token budget.

The scheduler is pure host code over ``Request`` objects and the page seam of
``KVCacheManager``. It returns a ``StepPlan`` (data); the engine executes it and reports
back through ``on_step_done``. This is the vLLM V1 baseline: first come, first served;
when a running request needs a page and none is free, the most recently admitted running
request is preempted (its pages freed, to be recomputed later). The RotaSched policies
plug in at the same seam.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from superinfer_jax.config import EngineConfig
from superinfer_jax.kv.page_allocator import KVCacheManager
from superinfer_jax.request import Request, RequestStatus


@dataclass
class StepPlan:
    """One step's work, as host ints. The engine executes it verbatim."""

    prefill: list[tuple[str, int]] = field(default_factory=list)  # (req_id, new tokens)
    decode: list[str] = field(default_factory=list)  # req_ids taking exactly one token
    preempted: list[str] = field(default_factory=list)  # freed now, recomputed later

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

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Drop a finished or aborted request and free its pages."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req.req_id)

    def schedule(self, now: float | None = None) -> StepPlan:
        now = time.perf_counter() if now is None else now
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(plan, budget, now)
        self._admit_waiting(plan, budget, now)
        return plan

    def _schedule_running(self, plan: StepPlan, budget: int, now: float) -> int:
        prefill_rows = 0
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            pending = req.num_pending_tokens
            if pending > 1 and prefill_rows >= self.config.max_prefill_rows:
                i += 1
                continue
            n = 1 if pending == 1 else min(pending, self.config.max_prefill_chunk, budget)
            if not self._reserve(req, n, plan, now):
                break  # req itself was preempted; everything after it already was
            if pending == 1:
                plan.decode.append(req.req_id)
            else:
                plan.prefill.append((req.req_id, n))
                prefill_rows += 1
            budget -= n
            i += 1
        return budget

    def _reserve(self, req: Request, n: int, plan: StepPlan, now: float) -> bool:
        """Pages for ``n`` more tokens of ``req``, preempting from the tail if needed."""
        total = req.num_computed_tokens + n
        while not self.kv.can_allocate(req.req_id, total):
            victim = self.running[-1]
            self._preempt(victim, plan, now)
            if victim is req:
                return False
        self.kv.allocate_for(req.req_id, total)
        return True

    def _preempt(self, req: Request, plan: StepPlan, now: float) -> None:
        self.running.remove(req)
        self.kv.free(req.req_id)
        req.num_recomputed_tokens += req.num_computed_tokens
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.set_status(RequestStatus.WAITING, now)
        self.waiting.appendleft(req)
        plan.preempted.append(req.req_id)
        plan.decode = [r for r in plan.decode if r != req.req_id]
        plan.prefill = [(r, n) for r, n in plan.prefill if r != req.req_id]

    def _admit_waiting(self, plan: StepPlan, budget: int, now: float) -> None:
        prefill_rows = len(plan.prefill)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.req_id in plan.preempted:
                break  # do not re-admit what this very step evicted
            pending = req.num_pending_tokens
            if pending > 1 and prefill_rows >= self.config.max_prefill_rows:
                break
            n = 1 if pending == 1 else min(pending, self.config.max_prefill_chunk, budget)
            if not self.kv.can_allocate(req.req_id, req.num_computed_tokens + n):
                break  # FCFS: the head waits for memory, nobody overtakes it
            self.kv.allocate_for(req.req_id, req.num_computed_tokens + n)
            self.waiting.popleft()
            self.running.append(req)
            req.set_status(RequestStatus.RUNNING, now)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            if pending == 1:
                plan.decode.append(req.req_id)
            else:
                plan.prefill.append((req.req_id, n))
                prefill_rows += 1
            budget -= n
