"""Who runs this step: one pipeline of stages; a ``Policy`` supplies the decisions.

Pure host code over ``Request`` objects and the page seam of ``TwoTierKVManager``.
``schedule`` returns a complete ``StepPlan``: rows, evictions, rotations with their page
copies, the eager shadows and the budget it ran under. The engine and the simulator
execute it, never re-derive it, and report back through ``on_rotated_out`` /
``on_rotated_in`` / ``on_rotation_failed`` and ``remove``.

Every step runs the same stages, in this order:

1. forced rotations: requests named in ``force_rotate_out`` (a test hook) rotate out;
2. ranking: if the policy says the step is contended, it ranks every request that could
   run (waiting, parked, running); otherwise the order is FCFS and nobody overtakes;
3. selection within pages, seats and the inbound transfer budget: from the head of the
   ranking, who fits on the device this step;
4. victims: running requests outside the selection leave, from the tail of the ranking,
   within the outbound transfer budget (the policy says where to: host or recompute);
5. the step's token budget (the policy's, when contended; else the configured one);
6. running rows, within the token budget and the padded prefill call; a row that needs
   a page when none is free evicts the last runner (contended: decode, prefill order);
7. rotate-ins: parked requests come back within seats and the inbound transfer budget
   (uncontended: oldest first, stopping at the first that cannot);
8. admissions: waiting requests start (uncontended: only once nothing is parked, FCFS
   with the head blocking; contended: the selected ones, in rank order);
9. eager shadows: host copies of full pages, within what the rotations left of the
   outbound transfer budget (only for a caller that issues them: ``shadowing``).

Per-step state is one ``StepBudget`` (and, when contended, one ``StepSelection``, which
runs stages 3 and 4) passed through the stages; the prefix cache's look-ups and pages
being prefilled are the ``PrefixPlanner``'s (``prefixes``). Nothing a step does walks
the whole waiting queue: the selection reads the ranking from its head and stops once
every runner was seen and the device is full, and the later stages read only what it
kept (a lazy ranking, ``rotasched.ranking``, then never orders the queue's tail).

Requests rotating or parked sit in ``rotary``; without room on the host (or without a
host tier) a rotation falls back to recomputation.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from superinfer_jax.config import BucketLimits, EngineConfig, bucket
from superinfer_jax.kv.page_allocator import KVCacheManager
from superinfer_jax.kv.two_tier import TwoTierKVManager
from superinfer_jax.request import ROTARY, ROTATING_IN, ROTATING_OUT, RUNNING, WAITING, Request
from superinfer_jax.sched.latency import LatencyModel
from superinfer_jax.sched.prefix_planner import PrefixPlanner
from superinfer_jax.sched.selection import Ranking, StepSelection, rest_by_arrival
from superinfer_jax.sched.step_plan import (
    HOST,
    NO_HIT,
    RECOMPUTE,
    PrefixHit,
    StepBudget,
    StepPlan,
    next_chunk,
)
from superinfer_jax.sched.waiting_queue import WaitingQueue

if TYPE_CHECKING:
    from superinfer_jax.sched.rotasched.policy import Policy

__all__ = ["HOST", "RECOMPUTE", "PrefixHit", "Ranking", "Scheduler", "StepBudget",
           "StepPlan", "StepSelection", "next_chunk"]


class Scheduler:
    """The stages over the request queues: ``policy`` decides, this class executes.
    ``page_bytes``: one KV page, for transfer-time predictions. ``latency``: the latency
    model, None until known. ``shadowing``: the caller issues eager shadow copies."""

    def __init__(self, config: EngineConfig, kv: KVCacheManager, policy: Policy, *,
                 page_bytes: int = 0, latency: LatencyModel | None = None,
                 shadowing: bool = False):
        self.config = config
        self.kv = kv
        self.policy = policy
        self.page_bytes = page_bytes
        self.latency = latency
        self.shadowing = (shadowing and config.duplex_kv.eager_shadowing
                          and isinstance(kv, TwoTierKVManager) and kv.num_host_pages > 0)
        self.waiting = WaitingQueue(need=self._first_chunk_pages)
        self.running: list[Request] = []  # admission order: the tail is preempted first
        self.rotary: list[Request] = []  # ROTATING_OUT, ROTARY, ROTATING_IN; oldest first
        self._rotating_in = 0  # of ``rotary``: ROTATING_IN (a seat each), counted
        self.force_rotate_out: set[str] = set()  # test hook: rotate these out next step
        self.seat_cap = config.engine.max_num_seqs  # ``Policy.seat_limit``, once a step
        self.prefixes = PrefixPlanner(config, kv, self.running)

    def set_latency_model(self, model: LatencyModel | None) -> None:
        """The latency model, once known (profiling needs the compiled engine)."""
        self.latency = model

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.rotary)

    def add(self, req: Request) -> None:
        self.waiting.append(req)
        self.prefixes.want(req)

    def remove(self, req: Request) -> None:
        """Drop a finished or aborted request and free its pages."""
        self.prefixes.unwant(req)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req in self.rotary:
            self.rotary.remove(req)
            self._rotating_in -= req.status == ROTATING_IN
        self.force_rotate_out.discard(req.req_id)
        self.prefixes.host_hits_in_flight.pop(req.req_id, None)
        self.kv.free(req.req_id)

    def candidates(self) -> list[Request]:
        """Every request that could run this step: waiting, parked, running, in that order."""
        parked = [r for r in self.rotary if r.status == ROTARY]
        return list(self.waiting) + parked + list(self.running)

    def rest_by_arrival(self, head: list[Request], room: Callable[[], int] | None = None,
                        listed: set[int] | None = None,
                        defer: Callable[[Request], bool] | None = None,
                        defer_before: int = 0, defer_after: int = 0) -> Iterator[Request]:
        """Every candidate not in ``head``, by arrival: ``selection.rest_by_arrival``."""
        return rest_by_arrival(self, head, room, listed, defer, defer_before, defer_after)

    def device_pages_in_use(self) -> tuple[int, int]:
        """(used, usable) device pages."""
        usable = self.kv.allocator.num_usable
        return usable - self.kv.num_free_pages, usable


    def schedule(self, now: float | None = None,
                 limits: BucketLimits | None = None) -> StepPlan:
        """``limits``: the call shapes compiled so far (default: all of them)."""
        now = time.perf_counter() if now is None else now
        plan, budget = StepPlan(), StepBudget.full(self.config, limits)
        self.prefixes.start_step()
        kv = self.kv
        if self.shadowing and budget.limits.copies and isinstance(kv, TwoTierKVManager) \
                and kv.host_cache is not None:
            # reclaimed cached pages go to the host tier (``_plan_shadows`` copies them)
            kv.spill_budget = self.config.duplex_kv.transfer_budget_pages
        self._rotate_forced(plan, now)
        self.seat_cap = self.policy.seat_limit(self)
        sel = None  # uncontended: FCFS, nobody overtakes
        if self.policy.contended(self):
            sel = self._select(self.policy.rank(self, now), budget)
            sel.evict_unselected(plan, budget, now)
            budget = self.policy.token_budget(self, budget, now, sel.keep)
        plan.budget = budget.copy()
        self._run_rows(plan, budget, now, contended=sel is not None)
        if self._rotate_in(sel, plan, budget, now):
            self._admit(sel, plan, budget, now)
        if self.shadowing and budget.limits.copies:  # DuplexKV's copies compiled
            self._plan_shadows(plan)
        return plan

    def prefix_hit(self, req: Request) -> PrefixHit:
        """The longest cached prefix of waiting ``req``, once per step (``PrefixPlanner``)."""
        return self.prefixes.hit(req)

    def _select(self, ranked: Iterable[Request], budget: StepBudget) -> StepSelection:
        """Stage 3: who, from the head of ``ranked``, fits on the device this step."""
        return StepSelection(self, budget).read(ranked)

    def _rotate_forced(self, plan: StepPlan, now: float) -> None:
        if not self.force_rotate_out:
            return  # the usual step: no pass over the runners
        for req in [r for r in self.running if r.req_id in self.force_rotate_out]:
            self._rotate_out(req, plan, now)
        self.force_rotate_out.clear()  # requests not running now are not rotated

    def _run_rows(self, plan: StepPlan, budget: StepBudget, now: float,
                  contended: bool) -> None:
        """Rows for the runners in admission order (contended: decode rows first, then
        prefill chunks, then ending runners); evictions for pages take the last row. At
        most ``deferred_rows`` grammar rows with a token in flight (``ModelRunner.resample``)."""
        if contended:
            decoding: list[Request] = []
            prefilling: list[Request] = []
            ending: list[Request] = []
            for r in self.running:  # ``Request.num_pending_tokens`` inlined (every runner)
                n = 0 if r.final_token_inflight else r.num_tokens - r.num_computed_tokens
                if n == 1:
                    decoding.append(r)
                elif n > 1:
                    prefilling.append(r)
                elif n == 0:
                    ending.append(r)
            rows = decoding + prefilling + ending
        else:
            rows = self.running
        i = 0
        deferrable = budget.limits.deferred_rows
        # a decode row whose last page has room skips ``_reserve`` (most rows); a
        # preemption rebinds ``plan.decode``, so it is read each time
        tables, page_size, max_decode = self.kv.page_tables, self.kv.page_size, \
            budget.limits.decode_rows
        while i < len(rows) and budget.tokens > 0:
            req = rows[i]
            pending = 0 if req.final_token_inflight \
                else req.num_tokens - req.num_computed_tokens  # ``num_pending_tokens``
            if pending == 1 and req.grammar is None and len(plan.decode) < max_decode:
                table = tables.get(req.req_id)
                if table is not None and req.num_computed_tokens < len(table) * page_size:
                    plan.decode.append(req.req_id)
                    budget.tokens -= 1
                    i += 1
                    continue
            if req.grammar is not None and req.num_inflight_tokens:
                if deferrable == 0:
                    i += 1  # no deferred-sampling slot left: it sits this step out
                    continue
                deferrable -= 1
            n = self._next_chunk(pending, plan, budget)
            if n == 0:
                i += 1  # its token in flight ends it (async scheduling), or no prefill room
                continue
            if not self._reserve(req, n, plan, rows, now):
                break  # req itself was evicted; everything after it already was
            self._add_row(plan, req.req_id, n, pending == 1)
            budget.tokens -= n
            i += 1

    def _rotate_in(self, sel: StepSelection | None, plan: StepPlan, budget: StepBudget,
                   now: float) -> bool:
        """Bring parked requests back within the seats and the inbound transfer budget.
        Whether admissions may follow: uncontended, only once nobody is parked."""
        if sel is None:
            for req in [r for r in self.rotary if r.status == ROTARY]:
                kv = self.kv
                assert isinstance(kv, TwoTierKVManager)
                cost = kv.rotation_cost_in(req.req_id)
                if self._num_seated() >= self.seat_cap or not kv.can_rotate_in(
                        req.req_id) or (plan.rotate_in and cost > budget.pages_in):
                    return False
                self._start_rotate_in(req, plan, now)
                budget.pages_in -= cost
            return self._rotating_in == len(self.rotary)
        for req in sel.kept_other:  # a parked request is never running
            if req.status != ROTARY:
                continue
            cost = self._host_pages(req)
            if self._num_seated() >= self.seat_cap:
                break
            assert isinstance(self.kv, TwoTierKVManager)  # only it parks requests
            if cost > budget.pages_in or not self.kv.can_rotate_in(req.req_id):
                continue
            self._start_rotate_in(req, plan, now)
            budget.pages_in -= cost
        return True

    def _admit(self, sel: StepSelection | None, plan: StepPlan, budget: StepBudget,
               now: float) -> None:
        """Uncontended: FCFS, the head waits for memory and nobody overtakes it.
        Contended: the selected waiting requests, in rank order."""
        if sel is None:
            while self.waiting and budget.tokens > 0 and self._num_seated() < self.seat_cap:
                head = self.waiting.first()  # not re-admitted when this very step evicted it
                if head.req_id in plan.preempted or not self._admit_one(head, plan, budget, now):
                    break  # the head waits for memory; nobody overtakes it
            return
        # a kept runner that is waiting now was preempted this step (``plan.preempted``)
        for req in sel.kept_other:
            if req.status != WAITING or budget.tokens <= 0:
                continue
            if req.req_id in plan.preempted or self._num_seated() >= self.seat_cap:
                continue
            self._admit_one(req, plan, budget, now)

    def _plan_shadows(self, plan: StepPlan) -> None:
        """Host copies of the runners' full, unshadowed pages within the outbound transfer
        budget left; first the spills (reclaimed cached pages, copied before their reuse)."""
        kv = self.kv
        assert isinstance(kv, TwoTierKVManager)
        spills = kv.take_spills()
        kv.spill_budget = 0
        moving = sum(len(m) for m in plan.moves_out) + (len(spills) if spills else 0)
        room = max(0, self.config.duplex_kv.transfer_budget_pages - moving)
        # only the runners with a full page past their shadowed ones (a few a step)
        page_size = kv.page_size
        computed = {r.req_id: r.num_computed_tokens for r in self.running
                    if r.num_computed_tokens // page_size > kv.num_shadowed_pages(r.req_id)}
        plan.shadows = ([spills] if spills else []) + kv.plan_shadows(computed, room)


    def _next_chunk(self, pending: int, plan: StepPlan, budget: StepBudget) -> int:
        """Tokens a request with ``pending`` tokens takes this step (``next_chunk``) within
        the token budget and the padded call (0: no room for another prefill row)."""
        if pending == 1:  # most rows: no prefill cap to work out
            return 1 if len(plan.decode) < budget.limits.decode_rows else 0
        return next_chunk(pending, min(self._prefill_chunk_cap(plan, budget), budget.tokens))

    def _first_chunk_pages(self, req: Request) -> int:
        """Pages a new request's first chunk needs, as known on arrival (with prefix
        caching a hit may lower it: 1, the least any waiting request needs)."""
        if self.kv.prefix_cache is not None:
            return 1
        chunk = next_chunk(req.num_pending_tokens, self.config.engine.max_prefill_chunk)
        return -(-(req.num_computed_tokens + chunk) // self.kv.page_size)

    def _prefill_chunk_cap(self, plan: StepPlan, budget: StepBudget) -> int:
        """Longest chunk one more prefill row may take this step (0: no more rows). A padded
        slot costs what a real token does, so the padded ``[row bucket, column bucket]``
        shape must fit the step's prefill slots."""
        cfg = self.config
        rows = len(plan.prefill) + 1
        if rows > min(cfg.engine.max_prefill_rows, budget.limits.prefill_rows):
            return 0
        row_bucket = bucket(rows, cfg.prefill_row_buckets)
        longest = max((n for _, n in plan.prefill), default=0)
        limits = budget.limits
        fits = [c for c in cfg.prefill_chunk_buckets
                if row_bucket * limits.prefill_columns(c) <= budget.prefill_slots
                and longest <= c and c <= limits.prefill_chunk]
        if fits:
            return fits[-1]
        # one row always makes progress
        return min(cfg.engine.max_prefill_chunk, limits.prefill_chunk) if rows == 1 else 0

    @staticmethod
    def _add_row(plan: StepPlan, req_id: str, n: int, decoding: bool) -> None:
        if decoding:
            plan.decode.append(req_id)
        else:
            plan.prefill.append((req_id, n))

    def _reserve(self, req: Request, n: int, plan: StepPlan, rows: list[Request],
                 now: float) -> bool:
        """Pages for ``n`` more tokens of ``req``, evicting the last of ``rows`` until they
        fit; False when ``req`` itself had to go."""
        total = req.num_computed_tokens + n
        while not self.kv.can_allocate(req.req_id, total):
            victim = rows[-1]
            self._evict(victim, plan, now)  # takes it out of ``running``
            if rows is not self.running:
                rows.pop()
            if victim is req:
                return False
        self.kv.allocate_for(req.req_id, total)
        return True

    def _host_pages(self, req: Request) -> int:
        """Pages ``req`` must move in before it can run (0 unless parked)."""
        if req.status == ROTARY:
            assert isinstance(self.kv, TwoTierKVManager)  # only it parks requests
            return self.kv.rotation_cost_in(req.req_id)
        return 0

    def _num_seated(self) -> int:
        """Requests holding a batch row: running, or on their way back to running."""
        return len(self.running) + self._rotating_in

    def _num_rotating_in(self) -> int:
        return self._rotating_in


    def _evict(self, req: Request, plan: StepPlan, now: float) -> None:
        """Take ``req`` off the device, where its policy says: the host, or recompute."""
        target = self.policy.evict_to(self, req)
        if target == HOST:
            self._rotate_out(req, plan, now)
        elif target == RECOMPUTE:
            self._preempt(req, plan, now)
        else:
            raise ValueError(f"policy {self.config.engine.policy!r}: evict_to returned {target!r}; "
                             f"expected {HOST!r} or {RECOMPUTE!r}")

    def _preempt(self, req: Request, plan: StepPlan, now: float) -> None:
        self.running.remove(req)
        self.kv.free(req.req_id)
        self._requeue_for_recompute(req, now)
        plan.preempted.append(req.req_id)
        plan.decode = [r for r in plan.decode if r != req.req_id]
        plan.prefill = [(r, n) for r, n in plan.prefill if r != req.req_id]

    def _rotate_out(self, req: Request, plan: StepPlan, now: float) -> None:
        """Park a running request on the host, or recompute it when the host has no room."""
        kv = self.kv
        moves = kv.try_rotate_out(req.req_id, req.num_computed_tokens) \
            if isinstance(kv, TwoTierKVManager) else None
        if moves is None:
            self._preempt(req, plan, now)
            return
        plan.moves_out.append(moves)
        plan.rotate_out.append(req.req_id)
        self.running.remove(req)
        self.rotary.append(req)
        req.num_rotations += 1
        req.set_status(ROTATING_OUT, now)

    def _start_rotate_in(self, req: Request, plan: StepPlan, now: float) -> None:
        """Bring a parked request back (device pages reserved now, runnable on arrival)."""
        assert isinstance(self.kv, TwoTierKVManager)
        plan.moves_in.append(self.kv.rotate_in(req.req_id))
        plan.rotate_in.append(req.req_id)
        req.set_status(ROTATING_IN, now)
        self._rotating_in += 1

    def _admit_one(self, req: Request, plan: StepPlan, budget: StepBudget,
                   now: float) -> bool:
        """Admit waiting ``req`` if rows and pages allow, with its first chunk or, by a
        host-tier hit, with those pages rotated in; whether it was admitted."""
        if req.num_inflight_tokens:
            return False  # evicted while its last token was in flight: recompute once it lands
        prefixes = self.prefixes
        if prefixes.fork_waits(req):
            return False
        kv = self.kv
        hit = prefixes.lookup(req) if prefixes.may_hit(req) else NO_HIT
        if hit.arriving:
            return False  # its prefix lands within a step or two: then it is a device hit
        host = hit.host[:max(0, budget.pages_in)]
        if host:
            return self._admit_from_host(req, hit.device, host, plan, budget, now)
        prefix = list(hit.device)
        hit_tokens = len(prefix) * kv.page_size
        pending = req.num_pending_tokens - hit_tokens
        n = self._next_chunk(pending, plan, budget)
        total = req.num_computed_tokens + hit_tokens + n
        if n == 0 or not (kv.can_allocate_with_prefix(prefix, total) if prefix
                          else kv.can_allocate(req.req_id, total)):
            return False
        if prefix:
            kv.take_prefix(req.req_id, prefix)
            req.num_computed_tokens = hit_tokens
        prefixes.count_hit(req, hit_tokens, hit_tokens)
        kv.allocate_for(req.req_id, total)
        self.waiting.remove(req)
        prefixes.unwant(req)
        self.running.append(req)
        prefixes.note_computing(req)
        req.set_status(RUNNING, now)
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        self._add_row(plan, req.req_id, n, pending == 1)
        budget.tokens -= n
        return True

    def _admit_from_host(self, req: Request, device: tuple[int, ...], host: tuple[int, ...],
                         plan: StepPlan, budget: StepBudget, now: float) -> bool:
        """Admit ``req`` by a host-tier hit: device pages taken, host pages rotated in (a
        seat held), and its first chunk's pages reserved, to run once they land."""
        kv = self.kv
        assert isinstance(kv, TwoTierKVManager)
        hit_tokens = (len(device) + len(host)) * kv.page_size
        total = hit_tokens + next_chunk(req.num_pending_tokens - hit_tokens,
                                        self.config.engine.max_prefill_chunk)
        if not kv.can_allocate_with_prefix(list(device), total):
            return False
        plan.moves_in.append(kv.take_host_prefix(req.req_id, list(device), list(host), total))
        plan.host_hits.append(req.req_id)
        budget.pages_in -= len(host)
        req.num_computed_tokens = hit_tokens
        first = req.first_scheduled_time is None
        self.prefixes.count_hit(req, len(device) * kv.page_size, hit_tokens)
        self.prefixes.host_hits_in_flight[req.req_id] = (len(host) * kv.page_size, first)
        self.waiting.remove(req)
        self.prefixes.unwant(req)
        self.rotary.append(req)
        req.set_status(ROTATING_IN, now)
        self._rotating_in += 1
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        return True

    def _requeue_for_recompute(self, req: Request, now: float) -> None:
        req.num_recomputed_tokens += req.num_computed_tokens
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.set_status(WAITING, now)
        self.waiting.appendleft(req)


    def on_rotated_out(self, req: Request, now: float) -> None:
        req.set_status(ROTARY, now)

    def on_rotated_in(self, req: Request, now: float) -> None:
        self.prefixes.host_hits_in_flight.pop(req.req_id, None)
        self.rotary.remove(req)
        self._rotating_in -= req.status == ROTATING_IN
        self.running.append(req)
        req.set_status(RUNNING, now)

    def on_rotation_failed(self, req: Request, now: float) -> None:
        """A copy failed: drop both tiers' pages and recompute, never serve wrong KV. A
        host-tier hit that never landed is not reported as one."""
        self.prefixes.take_back_host_hit(req)
        self.rotary.remove(req)
        self._rotating_in -= req.status == ROTATING_IN
        self.kv.free(req.req_id)
        self._requeue_for_recompute(req, now)

