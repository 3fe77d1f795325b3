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

Per-step state is one ``StepBudget`` (and, when contended, one ``Selection``) passed
through the stages, never kept on the instance. Nothing a step does walks the whole
waiting queue: the selection reads the ranking from its head and stops once every runner
was seen and the device is full, and the later stages read only what it kept (a lazy
ranking, ``rotasched.ranking``, then never orders the queue's tail).

Requests rotating or parked sit in ``rotary``; without room on the host (or without a
host tier) a rotation falls back to recomputation.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from heapq import merge
from itertools import chain
from typing import TYPE_CHECKING

from superinfer_jax.config import BucketLimits, EngineConfig, bucket
from superinfer_jax.kv.page_allocator import KVCacheManager
from superinfer_jax.kv.prefix_cache import extend_block_hashes
from superinfer_jax.kv.two_tier import TwoTierKVManager
from superinfer_jax.request import ROTARY, ROTATING_IN, ROTATING_OUT, RUNNING, WAITING, Request
from superinfer_jax.sched.latency import LatencyModel
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

__all__ = ["HOST", "RECOMPUTE", "PrefixHit", "Ranking", "Scheduler", "Selection",
           "StepBudget", "StepPlan", "next_chunk"]


@dataclass
class Ranking:
    """A ranking in two parts, for a policy whose order ends in FCFS: ``head``, most
    urgent first, then every other candidate by arrival (on a tie, waiting before parked,
    then in queue and parked order). ``Policy.rank`` may return one instead of a list:
    the selection reads the tail from the arrival-ordered queue and skips, unread, the
    requests that need more pages than are left, so a long queue costs a step nothing.
    Iterating it gives the whole order."""

    head: list[Request]
    scheduler: Scheduler
    # ids of the head's waiting and parked requests, when the policy has them at hand
    # (None: taken from the head); the tail leaves them out, and only them: a runner is
    # never in the tail, so the runners of a long head need not be listed each step
    listed: set[int] | None = None
    # tail requests that go after the rest of the tail, still by arrival (None: none)
    defer: Callable[[Request], bool] | None = None
    # the first entries of the arrival-ordered queue that ``defer`` is true of but for
    # requeued ones, known ahead (``WaitingQueue.missed_prefix``): left unread, not tested
    defer_before: int = 0
    # ids of head entries (not running) that may take only pages and seats no runner
    # needs: the selection keeps one only while every runner still fits, so it displaces
    # no runner (None: none)
    free_only: set[int] | None = None

    def __init__(self, head: list[Request], scheduler: Scheduler,
                 listed: set[int] | None = None,
                 defer: Callable[[Request], bool] | None = None,
                 defer_before: int = 0,
                 free_only: set[int] | None = None) -> None:  # written out: ``NATIVE_INIT``
        self.head = head
        self.scheduler = scheduler
        self.listed = listed
        self.defer = defer
        self.defer_before = defer_before
        self.free_only = free_only

    def __iter__(self) -> Iterator[Request]:
        return chain(self.head, self.scheduler.rest_by_arrival(
            self.head, listed=self.listed, defer=self.defer,
            defer_before=self.defer_before))


@dataclass
class Selection:
    """Who the selection kept this step (contended steps only), for the stages after it."""

    keep: set[str] = field(default_factory=set)  # ids of the kept requests
    kept: list[Request] = field(default_factory=list)  # the kept requests, in rank order
    runners: list[Request] = field(default_factory=list)  # every runner, in rank order
    # The same, split for the stages that read one part (a contended step has a runner
    # for most of ``kept``, and passes over them would find nothing to do):
    kept_other: list[Request] = field(default_factory=list)  # kept, not running: rank order
    dropped: list[Request] = field(default_factory=list)  # runners not kept: rank order

    def __init__(self) -> None:  # written out (``NATIVE_INIT``): one a contended step
        self.keep = set()
        self.kept = []
        self.runners = []
        self.kept_other = []
        self.dropped = []


class _Fill:
    """The device pages a selection has kept so far, for the room its ranking's tail is
    read with (``Scheduler.rest_by_arrival``)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.used = 0

    def room(self) -> int:
        return self.capacity - self.used


class Scheduler:
    """The stages over the request queues: ``policy`` decides, this class executes.
    ``page_bytes``: one KV page (the policies' transfer-time predictions). ``latency``: the
    latency model, None until known (the engine profiles it after warm-up and calls
    ``set_latency_model``). ``shadowing``: the caller issues eager shadow copies, so plan
    them (with ``config.eager_shadowing`` and a host tier)."""

    def __init__(self, config: EngineConfig, kv: KVCacheManager, policy: Policy, *,
                 page_bytes: int = 0, latency: LatencyModel | None = None,
                 shadowing: bool = False):
        self.config = config
        self.kv = kv
        self.policy = policy
        self.page_bytes = page_bytes
        self.latency = latency  # None until known (``set_latency_model``)
        self.shadowing = (shadowing and config.eager_shadowing
                          and isinstance(kv, TwoTierKVManager) and kv.num_host_pages > 0)
        # FIFO, and by arrival for the lag ranking and the selection of a Ranking's tail
        self.waiting = WaitingQueue(need=self._first_chunk_pages)
        self.running: list[Request] = []  # admission order: the tail is preempted first
        self.rotary: list[Request] = []  # ROTATING_OUT, ROTARY, ROTATING_IN; oldest first
        self._rotating_in = 0  # of ``rotary``: ROTATING_IN (a seat each), counted
        self.force_rotate_out: set[str] = set()  # test hook: rotate these out next step
        # Prefix hits looked up by this step's ranking and selection (a lookup per
        # waiting request per step, not one per question); admission looks up again, as
        # evictions earlier in the step may have reclaimed pages since.
        self._hits: dict[str, PrefixHit] = {}
        # Hashes of prompt pages the runners are prefilling this step (allocated, KV not
        # computed yet), built at this step's first look-up (``_computing_hashes``).
        self._computing: dict[bytes, None] | None = None
        # Host-tier hits in flight: req_id -> (host tokens, counted as the request's
        # cached tokens). A failed copy takes them back: those tokens are prefilled.
        self._host_hits_in_flight: dict[str, tuple[int, bool]] = {}
        # The prompt page hashes each request waiting for its first admission asked the
        # prefix cache to keep (``PrefixCache.want``), by request id.
        self._wants: dict[str, list[bytes]] = {}

    def set_latency_model(self, model: LatencyModel | None) -> None:
        """The latency model, once known (profiling needs the compiled engine)."""
        self.latency = model

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.rotary)

    def add(self, req: Request) -> None:
        self.waiting.append(req)
        self._want(req)

    def _want(self, req: Request) -> None:
        """Ask the prefix cache to keep the cached pages a new request will look up (those
        a hit may cover): it is known demand (``PrefixCache.want``)."""
        cache = self.kv.prefix_cache
        if cache is None or req.cache_key is None or req.num_computed_tokens \
                or not self.config.prefix_cache_keep_queued:
            return
        page_size = self.kv.page_size
        extend_block_hashes(req.block_hashes, req.prompt_token_ids, req.output_token_ids,
                            page_size, req.cache_key)
        hashes = req.block_hashes[:(req.num_tokens - 1) // page_size]
        if hashes:
            cache.want(hashes)
            self._wants[req.req_id] = hashes

    def _unwant(self, req: Request) -> None:
        """``req`` left the queue (admitted or gone): its pages are not kept for it."""
        hashes = self._wants.pop(req.req_id, None)
        if hashes is not None and self.kv.prefix_cache is not None:
            self.kv.prefix_cache.unwant(hashes)

    def remove(self, req: Request) -> None:
        """Drop a finished or aborted request and free its pages."""
        self._unwant(req)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req in self.rotary:
            self.rotary.remove(req)
            self._rotating_in -= req.status == ROTATING_IN
        self.force_rotate_out.discard(req.req_id)
        self._host_hits_in_flight.pop(req.req_id, None)
        self.kv.free(req.req_id)

    def candidates(self) -> list[Request]:
        """Every request that could run this step: waiting, parked, running (in that
        order; a stable sort keeps it among equals)."""
        parked = [r for r in self.rotary if r.status == ROTARY]
        return list(self.waiting) + parked + list(self.running)

    def rest_by_arrival(self, head: list[Request], room: Callable[[], int] | None = None,
                        listed: set[int] | None = None,
                        defer: Callable[[Request], bool] | None = None,
                        defer_before: int = 0) -> Iterator[Request]:
        """Every candidate not in ``head``, by arrival (a ``Ranking``'s tail). With
        ``room`` (the device pages still free), the waiting requests known to need more
        for their first chunk are left out (``WaitingQueue.walk``). ``listed``: the ids of
        the head's waiting and parked requests, if known (``Ranking.listed``). ``defer``:
        the requests it is true of come after all the others, in the same order.
        ``defer_before`` (with ``defer``): the first entries of the waiting queue by
        arrival are deferred unread, but for the requeued ones ``defer`` is false of, so
        a queue of requests that missed their TTFT costs a step nothing
        (``Ranking.defer_before``)."""
        if listed is None:
            listed = {id(r) for r in head}
        parked = sorted((r.arrival_time, j, r) for j, r in enumerate(
            q for q in self.rotary if q.status == ROTARY) if id(r) not in listed)
        parked_later: list[tuple[float, int, Request]] = []
        waiting = self.waiting
        start = 0
        early: list[tuple[float, int, Request]] = []  # requeued, before ``start``, kept
        if defer is not None:  # parked requests are few: split them once, up front
            parked_later = [e for e in parked if defer(e[2])]
            parked = [e for e in parked if not defer(e[2])]
            start = min(defer_before, len(waiting))
            if start and waiting.requeued:
                bound = waiting.by_arrival()[start - 1][:2]
                early = sorted(e for e in map(waiting.entry, waiting.requeued.values())
                               if e[:2] <= bound and id(e[2]) not in listed
                               and not defer(e[2]))
        waiting_later: list[tuple[float, int, Request]] = []
        k = 0
        for a, pos, r in chain(early, waiting.walk(room, start)):
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
            later = chain(((e[0], 0, e[2]) for e in waiting.walk(room, 0, start)
                           if id(e[2]) not in listed and id(e[2]) not in kept),
                          ((a, 0, r) for a, _, r in waiting_later))
            yield from (e[2] for e in merge(later, ((a, 1, r) for a, _, r in parked_later),
                                            key=_arrival_then_kind))

    def device_pages_in_use(self) -> tuple[int, int]:
        """(used, usable) device pages."""
        usable = self.kv.allocator.num_usable
        return usable - self.kv.num_free_pages, usable

    # -- the stages -------------------------------------------------------------------

    def schedule(self, now: float | None = None,
                 limits: BucketLimits | None = None) -> StepPlan:
        """``limits``: the call shapes compiled so far (default: all of them)."""
        now = time.perf_counter() if now is None else now
        plan, budget = StepPlan(), StepBudget.full(self.config, limits)
        self._hits.clear()
        self._computing = None
        if self.kv.prefix_cache is not None:
            self._register_full_pages()
        kv = self.kv
        if self.shadowing and budget.limits.copies and isinstance(kv, TwoTierKVManager) \
                and kv.host_cache is not None:
            kv.spill_budget = self.config.transfer_budget_pages  # reclaimed cached pages
            # go to the host tier this step (``_plan_shadows`` issues the copies)
        self._rotate_forced(plan, now)
        sel = None  # uncontended: FCFS, nobody overtakes
        if self.policy.contended(self):
            sel = self._select(self.policy.rank(self, now), budget)
            self._evict_unselected(sel, plan, budget, now)
            budget = self.policy.token_budget(self, budget, now, sel.keep)
        plan.budget = budget.copy()
        self._run_rows(plan, budget, now, contended=sel is not None)
        if self._rotate_in(sel, plan, budget, now):
            self._admit(sel, plan, budget, now)
        if self.shadowing and budget.limits.copies:  # DuplexKV's copies compiled
            self._plan_shadows(plan)
        return plan

    def _register_full_pages(self) -> None:
        """Prefix caching: the runners' pages that filled since the last step, and whose
        KV a dispatched step writes, become findable by hash (the device runs steps in
        order, so a later step reading them sees the KV). Without
        ``prefix_cache_generated`` only pages that lie wholly in the prompt: a page that
        holds a generated token is never registered, so it is freed, not cached."""
        kv, page_size = self.kv, self.kv.page_size
        generated = self.config.prefix_cache_generated
        for req in self.running:
            if req.cache_key is None:
                continue
            extend_block_hashes(req.block_hashes, req.prompt_token_ids, req.output_token_ids,
                                page_size, req.cache_key)
            computed = req.num_computed_tokens if generated \
                else min(req.num_computed_tokens, len(req.prompt_token_ids))
            kv.register_full_pages(req.req_id, req.block_hashes, computed,
                                   req.prompt_token_ids, req.output_token_ids)

    def prefix_hit(self, req: Request) -> PrefixHit:
        """The longest cached prefix of waiting ``req`` (no pages yet): shared device pages,
        then cache-only host pages, at most up to its last token (at least one token is
        computed, so the step that admits it samples from real logits). Looked up once
        per step for the ranking and the selection (policies price hits with it)."""
        if req.status != WAITING or not self._may_hit(req):
            return NO_HIT
        hit = self._hits.get(req.req_id)
        if hit is None:
            hit = self._hits[req.req_id] = self._lookup_prefix(req)
        return hit

    def _may_hit(self, req: Request) -> bool:
        """Whether ``req`` can take a cached prefix: it uses the cache, and has no pages."""
        return req.cache_key is not None and self.kv.prefix_cache is not None \
            and not req.num_computed_tokens

    def _lookup_prefix(self, req: Request) -> PrefixHit:
        kv, page_size = self.kv, self.kv.page_size
        assert req.cache_key is not None
        extend_block_hashes(req.block_hashes, req.prompt_token_ids, req.output_token_ids,
                            page_size, req.cache_key)
        max_pages = (req.num_tokens - 1) // page_size
        hashes = req.block_hashes
        device = kv.match_prefix(hashes, max_pages)
        two_tier = kv if isinstance(kv, TwoTierKVManager) else None
        host = two_tier.match_host_prefix(hashes, len(device), max_pages) \
            if two_tier is not None else []
        # the page after the hit, unless the hit ends the prompt (a simulated request's
        # hashes may stop short of its tokens: its trace's blocks); its KV is on the way
        # if a host hit is bringing it in or a runner is prefilling it
        after = hashes[len(device)] if not host and len(device) < min(max_pages, len(hashes)) \
            else None
        arriving = after is not None and (
            two_tier is not None and after in two_tier.arriving
            or after in self._computing_hashes())
        if device or host or arriving:
            return PrefixHit(tuple(device), tuple(host), arriving)
        return NO_HIT

    def _computing_hashes(self) -> dict[bytes, None]:
        """Hashes of the prompt pages that running requests are prefilling: allocated,
        their KV not computed yet. A waiting request whose cached prefix continues in one
        of them waits (``PrefixHit.arriving``) until that runner has computed it and it is
        a device hit, instead of prefilling the same tokens again at the same time: prefill
        once, then share (``_fork_waits`` does this for the choices of one request, and
        also while the first choice still waits). A burst of requests with one system
        prompt prefills it once. A runner that leaves (finished, rotated out, preempted)
        is not in the next step's map, so nobody waits on it for long."""
        computing = self._computing
        if computing is None:
            computing = self._computing = {}
            for r in self.running:
                self._note_computing(r)
        return computing

    def _note_computing(self, req: Request) -> None:
        """Add running ``req``'s prompt pages still to compute to this step's map (if
        built: one admitted after the map was built is added by ``_admit_one``)."""
        computing = self._computing
        if computing is None or req.cache_key is None:
            return
        page_size = self.kv.page_size
        full = len(req.prompt_token_ids) // page_size
        hashes = req.block_hashes
        for i in range(req.num_computed_tokens // page_size, min(full, len(hashes))):
            computing[hashes[i]] = None

    def _rotate_forced(self, plan: StepPlan, now: float) -> None:
        if not self.force_rotate_out:
            return  # the usual step: no pass over the runners
        for req in [r for r in self.running if r.req_id in self.force_rotate_out]:
            self._rotate_out(req, plan, now)
        self.force_rotate_out.clear()  # requests not running now are not rotated

    def _select(self, ranked: Iterable[Request], budget: StepBudget) -> Selection:
        """From the head: who fits in the device pool (what runners hold plus what is
        free, cached pages included: reclaiming one costs nothing, so it goes before any
        runner), the seats and the inbound transfer budget.

        The ranking is read once, and no further than needed: once every runner was seen
        (their order is the victims') and the pool is full (every request that is not
        running needs a page to run, except one whose final token is in flight, which
        is never left out), nobody after can be kept.

        With prefix caching a device page may be in several tables, and a waiting request
        may take cached pages: a shared page counts once, for the first kept request that
        holds it, and a waiting request's host hit needs its pages moved in."""
        kv = self.kv
        shared = kv.prefix_cache is not None
        capacity = kv.num_free_pages
        runners_shared: dict[str, list[int]] = {}
        tables = kv.page_tables  # ``page_table`` inlined: a look-up per runner per step
        if shared:
            for r in self.running:
                table = tables.get(r.req_id, [])
                capacity += len(table)
                # sharing is by prefix: a table's shared pages lead it
                runners_shared[r.req_id] = self._leading_shared(table)
        else:
            capacity += sum([len(tables.get(r.req_id, ())) for r in self.running])
        if runners_shared:  # a page two runners share is one page of the pool
            lead_pages = [p for lead in runners_shared.values() for p in lead]
            capacity -= len(lead_pages) - len(set(lead_pages))
        transfer = budget.pages_in
        used, seats = 0, self.config.max_num_seqs - self._rotating_in
        sel = Selection()
        keep, runners = sel.keep, sel.runners
        runners_left = len(self.running)
        stop_when_full = not any(r.final_token_inflight for r in self.waiting.requeued.values())
        counted: set[int] = set()  # shared device pages already counted for a kept request
        kept_tables: list[list[int]] = []  # of the kept runners
        # The ranking is read by index from its head (every runner is there), then from
        # the tail's generator, made only if the head runs out: under mypyc a ``chain``
        # costs a generic iterator call per request, and a lambda over ``used`` would make
        # every local it reads an attribute of a closure.
        fill = _Fill(capacity)
        ranking: Ranking | None = None
        head: list[Request] = []
        rest: Iterable[Request] = ()
        if isinstance(ranked, Ranking):
            ranking, head = ranked, ranked.head
        elif isinstance(ranked, list):
            head = ranked
        else:
            rest = ranked
        tail: Iterator[Request] | None = None
        num_head, at = len(head), 0
        # ``Ranking.free_only``: the pages no runner needs (free, less what the runners
        # grow into this step), taken by the kept requests that are not running in rank
        # order; a free-only request is kept only within them, and only with a seat left
        # for every runner not read yet
        free_only = ranking.free_only if ranking is not None else None
        spare = 0
        if free_only:
            spare = kv.num_free_pages - self._runners_growth()
        # This loop reads every runner of every contended step, so what it calls per
        # request is inlined: ``_pages_to_run`` (for everyone but a waiting request, whose
        # prefix hit counts) with ``Request.num_pending_tokens``. The lists' methods are
        # called on them, not through bound-method aliases: compiled, ``kept.append(r)`` is
        # a C call, an alias a generic call (3,930 against 2,530 ns a 150-item loop).
        running, rotary, waiting = RUNNING, ROTARY, WAITING
        page_size, max_chunk = kv.page_size, self.config.max_prefill_chunk
        kept, kept_other, dropped = sel.kept, sel.kept_other, sel.dropped
        pages: tuple[int, ...] | list[int] = ()  # shared device pages of the request
        while True:
            if at < num_head:
                req = head[at]
                at += 1
            else:
                if tail is None:
                    tail = iter(rest if ranking is None else self.rest_by_arrival(
                        head, room=fill.room, listed=ranking.listed, defer=ranking.defer,
                        defer_before=ranking.defer_before))
                got = next(tail, None)
                if got is None:
                    break
                req = got
            status = req.status
            if status == running:
                runners.append(req)
                runners_left -= 1
            if len(keep) >= seats:  # nobody else can be kept: no more look-ups
                if status == running:
                    dropped.append(req)
                if not runners_left:
                    break
                continue
            if status == waiting:
                need, moving = self._pages_to_run(req), 0
            else:
                pending = 0 if req.final_token_inflight \
                    else req.num_tokens - req.num_computed_tokens
                need = -(-(req.num_computed_tokens + (1 if pending == 1 else min(
                    pending, max_chunk))) // page_size)
                moving = self._host_pages(req) if status == rotary else 0
            if shared:
                pages = ()
                if status == running:
                    pages = runners_shared.get(req.req_id, ())
                    need -= sum(p in counted for p in pages)
                elif status == waiting:
                    hit = self.prefix_hit(req)
                    pages, moving = hit.device, min(len(hit.host), transfer)
                    # pages a kept runner holds are counted already: a runner holds a
                    # prefix of the hit, at the same positions of its table
                    held = max((_common_prefix(t, pages) for t in kept_tables), default=0) \
                        if pages and kv.refcount[pages[0]] > 0 else 0
                    need -= held + sum(p in counted for p in pages[held:])
            if used + need <= capacity and moving <= transfer and (
                    free_only is None or id(req) not in free_only
                    or need <= spare and len(keep) + 1 + runners_left <= seats):
                keep.add(req.req_id)
                kept.append(req)
                if status != running:
                    kept_other.append(req)
                    spare -= need
                if shared:
                    counted.update(pages)
                    if status == running:
                        kept_tables.append(kv.page_table(req.req_id))
                used += need
                fill.used = used
                transfer -= moving
            elif status == running:
                dropped.append(req)
            if used >= capacity and not runners_left and stop_when_full:
                break
        return sel

    def _runners_growth(self) -> int:
        """Device pages the runners need this step beyond those they hold (their next
        chunk's, as the selection prices it: the longest a step can give)."""
        tables, page_size = self.kv.page_tables, self.kv.page_size
        max_chunk = self.config.max_prefill_chunk
        growth = 0
        for r in self.running:
            pending = 0 if r.final_token_inflight else r.num_tokens - r.num_computed_tokens
            need = -(-(r.num_computed_tokens + (1 if pending == 1 else min(
                pending, max_chunk))) // page_size)
            growth += max(0, need - len(tables.get(r.req_id, ())))
        return growth

    def _evict_unselected(self, sel: Selection, plan: StepPlan, budget: StepBudget,
                          now: float) -> None:
        """Runners outside the selection leave, from the tail of the ranking. A runner
        that has produced tokens stays while the parked replies' pages would pass the
        policy's ``parked_page_limit`` (one parked reply is always allowed)."""
        kv = self.kv
        assert isinstance(kv, TwoTierKVManager)  # contention is a two-tier policy's notion
        limit = self.policy.parked_page_limit(self)
        parked = 0
        if limit is not None:
            for r in self.rotary:
                if r.token_times:
                    parked += len(kv.host_table(r.req_id) or kv.page_table(r.req_id))
        for req in reversed(sel.dropped):  # ``sel.runners`` outside ``sel.keep``
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
            self._evict(req, plan, now)
            if req.status == ROTATING_OUT:  # parked (not recomputed: no host room)
                parked += pages

    def _run_rows(self, plan: StepPlan, budget: StepBudget, now: float,
                  contended: bool) -> None:
        """Rows for the running requests, in admission order; when contended decode rows
        go first, then prefill chunks (under a TBT-sized budget a prefill early in the
        list must not crowd out a decoder behind it), then runners whose token in flight
        ends them. Evictions for pages take the last of that order.

        A structured-output request whose token is in flight runs with its sampling
        deferred (its mask depends on that token, which only the host's matcher can
        follow): the step computes its logits, a small second call samples it once the
        token has landed (``ModelRunner.resample``). At most ``config.deferred_rows`` such
        rows a step; the others sit the step out."""
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
        # a decode row whose last page has room needs no page: most rows of most steps,
        # so they skip ``_reserve`` (``_next_chunk`` is 1 while decode rows remain)
        # (``plan.decode`` is read each time: a preemption rebinds it)
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

    def _rotate_in(self, sel: Selection | None, plan: StepPlan, budget: StepBudget,
                   now: float) -> bool:
        """Bring parked requests back within the seats and the inbound transfer budget.
        Returns whether admissions may follow: contended, always; uncontended, only when
        nobody is left parked or on the way out (the parked ones are older, go first)."""
        if sel is None:
            for req in [r for r in self.rotary if r.status == ROTARY]:
                kv = self.kv
                assert isinstance(kv, TwoTierKVManager)
                cost = kv.rotation_cost_in(req.req_id)
                if self._num_seated() >= self.config.max_num_seqs or not kv.can_rotate_in(
                        req.req_id) or (plan.rotate_in and cost > budget.pages_in):
                    return False
                self._start_rotate_in(req, plan, now)
                budget.pages_in -= cost
            return self._rotating_in == len(self.rotary)
        for req in sel.kept_other:  # a parked request is never running
            if req.status != ROTARY:
                continue
            cost = self._host_pages(req)
            if self._num_seated() >= self.config.max_num_seqs:
                break
            assert isinstance(self.kv, TwoTierKVManager)  # only it parks requests
            if cost > budget.pages_in or not self.kv.can_rotate_in(req.req_id):
                continue
            self._start_rotate_in(req, plan, now)
            budget.pages_in -= cost
        return True

    def _admit(self, sel: Selection | None, plan: StepPlan, budget: StepBudget,
               now: float) -> None:
        """Uncontended: FCFS, the head waits for memory and nobody overtakes it.
        Contended: the selected waiting requests, in rank order."""
        max_seqs = self.config.max_num_seqs
        if sel is None:
            while self.waiting and budget.tokens > 0 and self._num_seated() < max_seqs:
                head = self.waiting.first()  # not re-admitted when this very step evicted it
                if head.req_id in plan.preempted or not self._admit_one(head, plan, budget, now):
                    break  # the head waits for memory; nobody overtakes it
            return
        # ``kept_other``: a kept runner that is waiting now was preempted this step, so
        # the loop would pass it by (``plan.preempted``)
        for req in sel.kept_other:
            if req.status != WAITING or budget.tokens <= 0:
                continue
            if req.req_id in plan.preempted or self._num_seated() >= max_seqs:
                continue
            self._admit_one(req, plan, budget, now)

    def _plan_shadows(self, plan: StepPlan) -> None:
        """Host copies of the runners' full, unshadowed pages, within what the plan's
        rotate-outs and spills left of the outbound transfer budget: DuplexKV issues them
        as given. First the spills: cached device pages without a host copy that this
        step's allocations reclaimed, so that they stay findable in the host tier (their
        copies read the pool before the step that reuses the pages writes it)."""
        kv = self.kv
        assert isinstance(kv, TwoTierKVManager)
        spills = kv.take_spills()  # evicted cached pages, copied before their reuse
        kv.spill_budget = 0
        moving = sum(len(m) for m in plan.moves_out) + (len(spills) if spills else 0)
        room = max(0, self.config.transfer_budget_pages - moving)
        # only the runners with a full page past their shadowed ones (a few a step: a
        # decoder fills a page every ``page_size`` tokens), not a dict of every runner
        page_size = kv.page_size
        computed = {r.req_id: r.num_computed_tokens for r in self.running
                    if r.num_computed_tokens // page_size > kv.num_shadowed_pages(r.req_id)}
        plan.shadows = ([spills] if spills else []) + kv.plan_shadows(computed, room)

    # -- rows and pages ---------------------------------------------------------------

    def _next_chunk(self, pending: int, plan: StepPlan, budget: StepBudget) -> int:
        """Tokens a request with ``pending`` tokens takes this step (``next_chunk``) within
        the token budget and the padded call (0: no room for another prefill row)."""
        if pending == 1:  # most rows: no prefill cap to work out
            return 1 if len(plan.decode) < budget.limits.decode_rows else 0
        return next_chunk(pending, min(self._prefill_chunk_cap(plan, budget), budget.tokens))

    def _leading_shared(self, table: list[int]) -> list[int]:
        """The leading pages of ``table`` that another table holds too: only a prefix of a
        table is ever shared (hits take prefixes), so the scan stops at the first page of
        its own."""
        refcount = self.kv.refcount
        n = 0
        for p in table:
            if refcount[p] <= 1:
                break
            n += 1
        return table[:n]

    def _first_chunk_pages(self, req: Request) -> int:
        """``_pages_to_run`` of a waiting request that has not run, as known when it
        arrives: without prefix caching it does not change while the request waits; with
        it, a hit may lower it, so 1 (the least any waiting request needs)."""
        if self.kv.prefix_cache is not None:
            return 1
        chunk = next_chunk(req.num_pending_tokens, self.config.max_prefill_chunk)
        return -(-(req.num_computed_tokens + chunk) // self.kv.page_size)

    def _pages_to_run(self, req: Request) -> int:
        """Device pages ``req`` holds after its next step, with the longest chunk a step
        can give it (the budget is not known yet when the selection asks); a waiting
        request's prefix hit is computed already."""
        computed, pending = req.num_computed_tokens, req.num_pending_tokens
        if req.status == WAITING:
            hit = self.prefix_hit(req).num_pages * self.kv.page_size
            computed, pending = computed + hit, pending - hit
        chunk = next_chunk(pending, self.config.max_prefill_chunk)
        return -(-(computed + chunk) // self.kv.page_size)

    def _prefill_chunk_cap(self, plan: StepPlan, budget: StepBudget) -> int:
        """Longest chunk one more prefill row may take this step (0: no more rows). The
        call is padded to ``[row bucket, column bucket]``, and a padded slot costs what a
        real token does, so the padded shape must fit the step's prefill slots: two rows
        of 200 tokens pad to 4x256 and ran 3.5x longer than one row of 256 (744 vs 211 ms
        on the CPU policy sweep), a stall for every decoder in the step."""
        cfg = self.config
        rows = len(plan.prefill) + 1
        if rows > min(cfg.max_prefill_rows, budget.limits.prefill_rows):
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
        return min(cfg.max_prefill_chunk, limits.prefill_chunk) if rows == 1 else 0

    @staticmethod
    def _add_row(plan: StepPlan, req_id: str, n: int, decoding: bool) -> None:
        if decoding:
            plan.decode.append(req_id)
        else:
            plan.prefill.append((req_id, n))

    def _reserve(self, req: Request, n: int, plan: StepPlan, rows: list[Request],
                 now: float) -> bool:
        """Pages for ``n`` more tokens of ``req``, evicting the last of ``rows`` (``running``
        or its reordering) until they fit; False when ``req`` itself had to go."""
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

    # -- moving requests --------------------------------------------------------------

    def _evict(self, req: Request, plan: StepPlan, now: float) -> None:
        """Take ``req`` off the device, where its policy says: the host, or recompute."""
        target = self.policy.evict_to(self, req)
        if target == HOST:
            self._rotate_out(req, plan, now)
        elif target == RECOMPUTE:
            self._preempt(req, plan, now)
        else:
            raise ValueError(f"policy {self.config.policy!r}: evict_to returned {target!r}; "
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
        """Admit waiting ``req`` if rows and pages allow: with its first chunk, or, when
        its prefix continues in the host cache, with those pages rotated in (within the
        step's inbound transfer budget; the rest is prefilled once they landed). Returns
        whether it was admitted."""
        if req.num_inflight_tokens:
            return False  # evicted while its last token was in flight: recompute once it lands
        if self._fork_waits(req):
            return False
        kv = self.kv
        hit = self._lookup_prefix(req) if self._may_hit(req) else NO_HIT
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
        self._count_hit(req, hit_tokens, hit_tokens)
        kv.allocate_for(req.req_id, total)
        self.waiting.remove(req)
        self._unwant(req)
        self.running.append(req)
        self._note_computing(req)
        req.set_status(RUNNING, now)
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        self._add_row(plan, req.req_id, n, pending == 1)
        budget.tokens -= n
        return True

    def _fork_waits(self, req: Request) -> bool:
        """Whether ``req``, a sibling of an ``n > 1`` request, waits for the first choice
        to have its prompt's full pages computed, so that it takes them from the prefix
        cache instead of prefilling them again (prefill once, then fork)."""
        parent = req.fork_of
        if parent is None or self.kv.prefix_cache is None or parent.cache_key is None \
                or parent.cache_key != req.cache_key or parent.status.is_finished:
            return False
        full = len(parent.prompt_token_ids) // self.kv.page_size * self.kv.page_size
        return parent.num_computed_tokens < full

    def _admit_from_host(self, req: Request, device: tuple[int, ...], host: tuple[int, ...],
                         plan: StepPlan, budget: StepBudget, now: float) -> bool:
        """Admit ``req`` by a host-tier hit: it takes the device pages of its prefix and
        rotates the host pages in (ROTATING_IN, a seat held); once they land it runs
        like a request whose prefix was found on the device. Its first chunk's pages are
        reserved now, with the hit's, so that it can run as soon as they land."""
        kv = self.kv
        assert isinstance(kv, TwoTierKVManager)
        hit_tokens = (len(device) + len(host)) * kv.page_size
        total = hit_tokens + next_chunk(req.num_pending_tokens - hit_tokens,
                                        self.config.max_prefill_chunk)
        if not kv.can_allocate_with_prefix(list(device), total):
            return False
        plan.moves_in.append(kv.take_host_prefix(req.req_id, list(device), list(host), total))
        plan.host_hits.append(req.req_id)
        budget.pages_in -= len(host)
        req.num_computed_tokens = hit_tokens
        first = req.first_scheduled_time is None
        self._count_hit(req, len(device) * kv.page_size, hit_tokens)
        self._host_hits_in_flight[req.req_id] = (len(host) * kv.page_size, first)
        self.waiting.remove(req)
        self._unwant(req)
        self.rotary.append(req)
        req.set_status(ROTATING_IN, now)
        self._rotating_in += 1
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        return True

    def _count_hit(self, req: Request, device_tokens: int, hit_tokens: int) -> None:
        """vLLM's prefix-cache counters (device tier; the host tier counts its own) and the
        request's cached tokens, at its first admission."""
        cache = self.kv.prefix_cache
        if cache is None or req.cache_key is None:
            return
        cache.queries += req.num_tokens
        cache.hits += device_tokens
        if req.first_scheduled_time is None:
            req.num_cached_tokens = hit_tokens

    def _requeue_for_recompute(self, req: Request, now: float) -> None:
        req.num_recomputed_tokens += req.num_computed_tokens
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.set_status(WAITING, now)
        self.waiting.appendleft(req)

    # -- what the engine reports ------------------------------------------------------

    def on_rotated_out(self, req: Request, now: float) -> None:
        req.set_status(ROTARY, now)

    def on_rotated_in(self, req: Request, now: float) -> None:
        self._host_hits_in_flight.pop(req.req_id, None)
        self.rotary.remove(req)
        self._rotating_in -= req.status == ROTATING_IN
        self.running.append(req)
        req.set_status(RUNNING, now)

    def on_rotation_failed(self, req: Request, now: float) -> None:
        """A copy failed: drop both tiers' pages and recompute, never serve wrong KV. A
        host-tier hit that never landed is not reported as one."""
        host_tokens, first = self._host_hits_in_flight.pop(req.req_id, (0, False))
        if host_tokens:
            if first:
                req.num_cached_tokens -= host_tokens
            assert isinstance(self.kv, TwoTierKVManager) and self.kv.host_cache is not None
            self.kv.host_cache.hits -= host_tokens
        self.rotary.remove(req)
        self._rotating_in -= req.status == ROTATING_IN
        self.kv.free(req.req_id)
        self._requeue_for_recompute(req, now)


def _common_prefix(table: list[int], pages: tuple[int, ...]) -> int:
    """How many leading pages ``table`` and ``pages`` have in common."""
    n = 0
    for a, b in zip(table, pages, strict=False):
        if a != b:
            break
        n += 1
    return n


def _arrival_then_kind(e: tuple[float, int, Request]) -> tuple[float, int]:
    return e[0], e[1]
