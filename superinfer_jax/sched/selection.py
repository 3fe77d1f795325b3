"""Stages 3 and 4 of a contended step: who, from the head of the ranking, fits on the
device (``StepSelection``, with the budget it reads under), and which runners leave.
A ``Ranking``'s tail is the arrival-ordered queue, read lazily: a long queue costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from heapq import merge
from itertools import chain
from typing import TYPE_CHECKING

from superinfer_jax.kv.two_tier import TwoTierKVManager
from superinfer_jax.request import ROTARY, ROTATING_OUT, RUNNING, WAITING, Request, RequestStatus
from superinfer_jax.sched.step_plan import StepBudget, StepPlan, next_chunk

if TYPE_CHECKING:
    from superinfer_jax.sched.scheduler import Scheduler

__all__ = ["Ranking", "StepSelection", "rest_by_arrival"]


@dataclass
class Ranking:
    """A ranking in two parts: ``head``, most urgent first, then every other candidate by
    arrival (ties: waiting before parked). Iterating it gives the whole order."""

    head: list[Request]
    scheduler: Scheduler
    # ids of the head's waiting and parked requests, left out of the tail (None: the head)
    listed: set[int] | None = None
    # tail requests that go after the rest of the tail, still by arrival (None: none)
    defer: Callable[[Request], bool] | None = None
    # leading queue entries known deferred (``WaitingQueue.missed_prefix``): left unread
    defer_before: int = 0
    # leading queue entries never deferred (waited past the deferral's end): read first
    defer_after: int = 0
    # ids of head entries that may take only pages and seats no runner needs (None: none)
    free_only: set[int] | None = None

    def __init__(self, head: list[Request], scheduler: Scheduler,
                 listed: set[int] | None = None,
                 defer: Callable[[Request], bool] | None = None,
                 defer_before: int = 0,
                 free_only: set[int] | None = None,
                 defer_after: int = 0) -> None:  # written out: ``NATIVE_INIT``
        self.head = head
        self.scheduler = scheduler
        self.listed = listed
        self.defer = defer
        self.defer_before = defer_before
        self.defer_after = defer_after
        self.free_only = free_only

    def __iter__(self) -> Iterator[Request]:
        return chain(self.head, rest_by_arrival(
            self.scheduler, self.head, listed=self.listed, defer=self.defer,
            defer_before=self.defer_before, defer_after=self.defer_after))


def rest_by_arrival(s: Scheduler, head: list[Request], room: Callable[[], int] | None = None,
                    listed: set[int] | None = None,
                    defer: Callable[[Request], bool] | None = None,
                    defer_before: int = 0, defer_after: int = 0) -> Iterator[Request]:
    """Every candidate not in ``head``, by arrival (a ``Ranking``'s tail); with ``room``,
    waiting requests known to need more pages are skipped (``WaitingQueue.walk``). With
    ``defer``, the queue's first ``defer_after`` entries are never deferred (read first),
    the entries from there to ``defer_before`` are (but for requeued ones ``defer``
    keeps), and ``defer`` tests the rest."""
    if listed is None:
        listed = {id(r) for r in head}
    parked = sorted((r.arrival_time, j, r) for j, r in enumerate(
        q for q in s.rotary if q.status == ROTARY) if id(r) not in listed)
    parked_later: list[tuple[float, int, Request]] = []
    waiting = s.waiting
    start = lead = 0
    early: list[tuple[float, int, Request]] = []  # requeued, from ``lead`` to ``start``, kept
    if defer is not None:  # parked requests are few: split them once, up front
        parked_later = [e for e in parked if defer(e[2])]
        parked = [e for e in parked if not defer(e[2])]
        start = min(defer_before, len(waiting))
        lead = min(defer_after, start)
        if start > lead and waiting.requeued:
            entries = waiting.by_arrival()
            low, bound = entries[lead][:2], entries[start - 1][:2]
            early = sorted(e for e in map(waiting.entry, waiting.requeued.values())
                           if low <= e[:2] <= bound and id(e[2]) not in listed
                           and not defer(e[2]))
    waiting_later: list[tuple[float, int, Request]] = []
    k = 0
    first = waiting.walk(room, 0, lead) if lead else ()
    for a, pos, r in chain(first, early, waiting.walk(room, start)):
        if id(r) in listed:
            continue
        while k < len(parked) and parked[k][0] < a:  # a tie: waiting first
            yield parked[k][2]
            k += 1
        if defer is not None and defer(r):
            waiting_later.append((a, pos, r))
            continue
        yield r
    yield from (e[2] for e in parked[k:])
    if start or waiting_later or parked_later:  # the deferred, merged the same way
        kept = {id(e[2]) for e in early}
        # by (arrival, waiting before parked), each list in its own order
        later = chain(((e[0], 0, e[2]) for e in waiting.walk(room, lead, start)
                       if id(e[2]) not in listed and id(e[2]) not in kept),
                      ((a, 0, r) for a, _, r in waiting_later))
        yield from (e[2] for e in merge(later, ((a, 1, r) for a, _, r in parked_later),
                                        key=_arrival_then_kind))


class StepSelection:
    """Who a contended step keeps, read from the head of the ranking within its budget:
    ``capacity`` device pages (held by runners or free, cached ones included), ``seats``
    and ``transfer`` inbound pages. A page shared by several tables counts once. For the
    later stages: ``keep`` (ids), ``kept`` and ``runners`` (rank order), ``kept_other``
    (kept, not running) and ``dropped`` (runners not kept)."""

    def __init__(self, s: Scheduler, budget: StepBudget) -> None:
        self.s = s
        self.keep: set[str] = set()
        self.kept: list[Request] = []
        self.runners: list[Request] = []
        self.kept_other: list[Request] = []
        self.dropped: list[Request] = []
        self.shared = s.kv.prefix_cache is not None
        self.runners_shared: dict[str, list[int]] = {}  # a runner's leading shared pages
        self.capacity = self._capacity()
        self.used = 0
        self.transfer = budget.pages_in
        self.seats = s.seat_cap - s._rotating_in
        self.spare = 0  # pages no runner needs, for ``Ranking.free_only`` entries
        self.counted: set[int] = set()  # shared pages already counted for a kept request
        self.kept_tables: list[list[int]] = []  # of the kept runners

    def room(self) -> int:
        """Device pages not yet taken by the kept requests."""
        return self.capacity - self.used

    def _capacity(self) -> int:
        kv = self.s.kv
        capacity = kv.num_free_pages
        tables = kv.page_tables  # ``page_table`` inlined: a look-up per runner per step
        if not self.shared:
            return capacity + sum([len(tables.get(r.req_id, ())) for r in self.s.running])
        runners_shared = self.runners_shared
        for r in self.s.running:
            table = tables.get(r.req_id, [])
            capacity += len(table)
            runners_shared[r.req_id] = _leading_shared(kv.refcount, table)
        if runners_shared:  # a page two runners share is one page of the pool
            lead_pages = [p for lead in runners_shared.values() for p in lead]
            capacity -= len(lead_pages) - len(set(lead_pages))
        return capacity

    def read(self, ranked: Iterable[Request]) -> StepSelection:
        """Read ``ranked`` once, and stop once every runner was seen and the pool is full:
        nobody after can be kept (unless a final token is in flight)."""
        s = self.s
        keep, runners, dropped = self.keep, self.runners, self.dropped
        # the head by index, then the tail's generator (compiled, ``chain`` costs more)
        ranking: Ranking | None = None
        head: list[Request] = []
        tail: Iterator[Request] | None = None
        if isinstance(ranked, Ranking):
            ranking, head = ranked, ranked.head
        elif isinstance(ranked, list):
            head, tail = ranked, iter(())
        else:
            tail = iter(ranked)
        free_only = ranking.free_only if ranking is not None else None
        if free_only:
            self.spare = s.kv.num_free_pages - self._runners_growth()
        runners_left = len(s.running)
        stop_when_full = not any(r.final_token_inflight for r in s.waiting.requeued.values())
        num_head, at = len(head), 0
        while True:
            if at < num_head:
                req = head[at]
                at += 1
            else:
                if tail is None:
                    assert ranking is not None
                    tail = rest_by_arrival(s, head, room=self.room, listed=ranking.listed,
                                           defer=ranking.defer,
                                           defer_before=ranking.defer_before,
                                           defer_after=ranking.defer_after)
                got = next(tail, None)
                if got is None:
                    break
                req = got
            status = req.status
            if status == RUNNING:
                runners.append(req)
                runners_left -= 1
            if len(keep) >= self.seats:  # nobody else can be kept: no more look-ups
                if status == RUNNING:
                    dropped.append(req)
                if not runners_left:
                    break
                continue
            need, moving, pages = self._price(req, status)
            if self.used + need <= self.capacity and moving <= self.transfer and (
                    free_only is None or id(req) not in free_only
                    or need <= self.spare and len(keep) + 1 + runners_left <= self.seats):
                self._keep(req, status, need, moving, pages)
            elif status == RUNNING:
                dropped.append(req)
            if self.used >= self.capacity and not runners_left and stop_when_full:
                break
        return self

    def evict_unselected(self, plan: StepPlan, budget: StepBudget, now: float) -> None:
        """Stage 4: runners outside the selection leave, from the tail of the ranking; a
        runner with tokens stays while parking it would pass ``parked_page_limit``."""
        s = self.s
        kv = s.kv
        assert isinstance(kv, TwoTierKVManager)  # contention is a two-tier policy's notion
        limit = s.policy.parked_page_limit(s)
        parked = 0
        if limit is not None:  # the parked replies kept now come back: not counted
            keep = self.keep
            for r in s.rotary:
                if r.token_times and r.req_id not in keep:
                    parked += len(kv.host_table(r.req_id) or kv.page_table(r.req_id))
        for req in reversed(self.dropped):
            if req.status != RUNNING:
                continue
            pages = len(kv.page_table(req.req_id)) if limit is not None and req.token_times \
                else 0
            if pages and parked and limit is not None and parked + pages > limit:
                continue
            cost = kv.rotation_cost_out(req.req_id)
            if cost > budget.pages_out:
                continue
            budget.pages_out -= cost
            s._evict(req, plan, now)
            if req.status == ROTATING_OUT:  # parked (not recomputed: no host room)
                parked += pages

    def _price(self, req: Request, status: RequestStatus
               ) -> tuple[int, int, tuple[int, ...] | list[int]]:
        """(device pages ``req`` needs to run, pages it moves in, its shared device pages)."""
        s = self.s
        if status == WAITING:
            need, moving = self._pages_to_run(req), 0
        else:
            pending = 0 if req.final_token_inflight \
                else req.num_tokens - req.num_computed_tokens
            need = -(-(req.num_computed_tokens + (1 if pending == 1 else min(
                pending, s.config.engine.max_prefill_chunk))) // s.kv.page_size)
            moving = s._host_pages(req) if status == ROTARY else 0
        pages: tuple[int, ...] | list[int] = ()
        if self.shared:
            counted = self.counted
            if status == RUNNING:
                pages = self.runners_shared.get(req.req_id, ())
                need -= sum(p in counted for p in pages)
            elif status == WAITING:
                hit = s.prefix_hit(req)
                pages, moving = hit.device, min(len(hit.host), self.transfer)
                # pages a kept runner holds (a prefix of the hit) are counted already
                held = max((_common_prefix(t, pages) for t in self.kept_tables), default=0) \
                    if pages and s.kv.refcount[pages[0]] > 0 else 0
                need -= held + sum(p in counted for p in pages[held:])
        return need, moving, pages

    def _keep(self, req: Request, status: RequestStatus, need: int, moving: int,
              pages: tuple[int, ...] | list[int]) -> None:
        self.keep.add(req.req_id)
        self.kept.append(req)
        if status != RUNNING:
            self.kept_other.append(req)
            self.spare -= need
        if self.shared:
            self.counted.update(pages)
            if status == RUNNING:
                self.kept_tables.append(self.s.kv.page_table(req.req_id))
        self.used += need
        self.transfer -= moving

    def _pages_to_run(self, req: Request) -> int:
        """Device pages waiting ``req`` holds after its next step, with the longest chunk a
        step can give it and its prefix hit computed."""
        s = self.s
        page_size = s.kv.page_size
        hit = s.prefix_hit(req).num_pages * page_size
        computed = req.num_computed_tokens + hit
        chunk = next_chunk(req.num_pending_tokens - hit, s.config.engine.max_prefill_chunk)
        return -(-(computed + chunk) // page_size)

    def _runners_growth(self) -> int:
        """Device pages the runners need this step beyond those they hold."""
        s = self.s
        tables, page_size = s.kv.page_tables, s.kv.page_size
        max_chunk = s.config.engine.max_prefill_chunk
        growth = 0
        for r in s.running:
            pending = 0 if r.final_token_inflight else r.num_tokens - r.num_computed_tokens
            need = -(-(r.num_computed_tokens + (1 if pending == 1 else min(
                pending, max_chunk))) // page_size)
            growth += max(0, need - len(tables.get(r.req_id, ())))
        return growth


def _leading_shared(refcount: list[int], table: list[int]) -> list[int]:
    """The leading pages of ``table`` that another table holds too (hits share prefixes)."""
    n = 0
    for p in table:
        if refcount[p] <= 1:
            break
        n += 1
    return table[:n]


def _common_prefix(table: list[int], pages: tuple[int, ...] | list[int]) -> int:
    """How many leading pages ``table`` and ``pages`` have in common."""
    n = 0
    for a, b in zip(table, pages, strict=False):
        if a != b:
            break
        n += 1
    return n


def _arrival_then_kind(e: tuple[float, int, Request]) -> tuple[float, int]:
    return e[0], e[1]
