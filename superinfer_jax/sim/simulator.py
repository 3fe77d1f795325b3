"""Discrete-event simulator: the engine's step loop, with the model and the copies priced.

It drives the *same* scheduler (``make_scheduler``) and page bookkeeping
(``TwoTierKVManager``) as ``engine.LLMEngine`` and executes its plans as they are; only
the model step and the page copies are priced by a ``CostModel``. Events, in time order:

- *arrival*: a request joins the scheduler at the next step start, stamped with its true
  arrival time;
- *copy done*: observed at the next step start, as ``DuplexKV.poll`` observes
  ``is_ready`` (rotate-outs first, then rotate-ins, each in issue order);
- *step done*: a step starting at ``t`` schedules and issues its copies at ``t``, then runs
  the prefill call and the decode call; prefill rows get their token when the first call
  ends, decode rows when the second ends, and the next step starts then. With nothing
  to run, the loop waits for the next arrival or copy completion.

Copies queue per direction (``Link``); where the cost model overlaps the directions, a
batch that runs while the other direction is busy gets the duplex bandwidth. A
rotate-out is done after every earlier copy of its direction, shadows included.
Workloads and their synthetic prompts: ``sim.request_specs``.
"""

from __future__ import annotations

import dataclasses
import gc
import heapq
import time
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from superinfer_jax.config import EngineConfig
from superinfer_jax.kv.prefix_cache import isolation_key
from superinfer_jax.kv.two_tier import TwoTierKVManager
from superinfer_jax.request import Request, RequestStatus, SamplingParams
from superinfer_jax.sched.latency import LatencyModel
from superinfer_jax.sched.rotasched.registry import make_scheduler
from superinfer_jax.sched.scheduler import StepPlan
from superinfer_jax.sim.cost import CallShape, CostModel
from superinfer_jax.sim.request_specs import (
    ConversationSpec,
    HashIdTokens,
    RequestSpec,
    check_conversations,
    check_specs,
)
from superinfer_jax.sim.speculation import SpecState, SpeculationSpec, decode_shape, row_limits

OUT, IN = 0, 1  # copy directions: device -> host, host -> device
_SAMPLING = SamplingParams(max_tokens=1, ignore_eos=True)  # unused by policies; shared


class SimRequest(Request):
    """A ``Request`` without stored token ids (a ``range`` or ``HashIdTokens`` prompt), so
    100,000 fit in memory: token times are a list while it runs (a C call to append when
    compiled) and an ``array('d')`` once finished. Equality is identity."""

    num_tokens = 0  # shadows Request.num_tokens (a property): an instance counter here
    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def __init__(self, req_id: str, spec: RequestSpec):
        prompt: Sequence[int] = range(spec.prompt_len) if spec.hash_ids is None else \
            HashIdTokens(spec.hash_ids, spec.block_tokens, spec.prompt_len)
        super().__init__(req_id, prompt,
                         _SAMPLING, slo=spec.slo,
                         arrival_time=spec.arrival_s)
        self.token_times = []  # an array once finished (``_Run._finish``)
        self.num_tokens = spec.prompt_len
        self.output_len = spec.output_len
        self.num_output = 0

    @property
    def max_output_tokens(self) -> int:
        return self.output_len

    @property
    def max_tokens_left(self) -> int:
        return self.output_len - self.num_output

    def _log_transition(self, now: float, status: RequestStatus) -> None:
        """No transition log: nothing reads it, and it would cost memory per rotation."""


@dataclass
class Link:
    """The host link, one FIFO queue per direction."""

    cost: CostModel
    busy_until: list[float] = field(default_factory=lambda: [0.0, 0.0])
    pages: list[int] = field(default_factory=lambda: [0, 0])
    busy_s: list[float] = field(default_factory=lambda: [0.0, 0.0])

    def issue(self, direction: int, num_pages: int, now: float, other_active: bool) -> float:
        """Queue a batch; returns when it completes (an empty batch: when the queue drains)."""
        start = max(now, self.busy_until[direction])
        if not self.cost.overlaps_directions:
            start = max(start, self.busy_until[1 - direction])
        if num_pages == 0:
            return start
        duplex = other_active or self.busy_until[1 - direction] > start
        took = self.cost.transfer_s(num_pages, duplex)
        self.busy_until[direction] = start + took
        self.pages[direction] += num_pages
        self.busy_s[direction] += took
        return start + took


@dataclass
class SimResult:
    """What a run produced: the finished requests (in spec order) and counters."""

    requests: list[SimRequest]
    duration_s: float  # simulated: first arrival to last token
    wall_s: float  # real seconds the simulation took
    num_steps: int
    num_prefill_tokens: int
    num_decode_tokens: int
    pages_out: int
    pages_in: int
    shadow_pages: int
    link_busy_s: tuple[float, float]  # (out, in) seconds the link was copying
    num_device_pages: int
    num_host_pages: int
    cost_name: str
    policy: str
    # prefix caching: the caches' counters of prompt tokens over every admission
    prefix_caching: bool = False
    prefix_cache_queries: int = 0
    prefix_cache_device_hits: int = 0
    prefix_cache_host_hits: int = 0
    prefix_hit_pages_in: int = 0  # of pages_in: host-tier hits copied in (not rotations)
    # ``time_schedule``: per ``schedule`` call, the queue length and the host seconds
    schedule_queue: array | None = None  # array('l')
    schedule_s: array | None = None  # array('d')
    # ``run_conversations``: request id -> (conversation index, turn index)
    turn_of: dict[str, tuple[int, int]] | None = None
    # with speculation: its counters (``SpecState.summary``)
    speculation: dict[str, Any] | None = None


class Simulator:
    """One engine configuration on one cost model; ``run`` plays a workload through it.
    ``speculation``: decode rows verify proposals (``sim.speculation``); None: none."""

    def __init__(self, config: EngineConfig, cost: CostModel, num_device_pages: int,
                 num_host_pages: int = 0, latency: LatencyModel | None = None,
                 speculation: SpeculationSpec | None = None):
        if num_device_pages < config.max_pages_per_seq + 1:
            raise ValueError(
                f"num_device_pages ({num_device_pages}) cannot hold one request of "
                f"max_model_len {config.model.max_model_len} ({config.max_pages_per_seq + 1} "
                f"pages incl. the null page)")
        if num_host_pages < 0:
            raise ValueError(f"num_host_pages must be >= 0, got {num_host_pages}")
        self.config = config
        self.cost = cost
        self.num_device_pages = num_device_pages
        self.num_host_pages = num_host_pages
        self.latency = latency
        self.speculation = speculation

    def run(self, specs: Sequence[RequestSpec],
            progress: Callable[[int], None] | None = None,
            time_schedule: bool = False) -> SimResult:
        """Simulate ``specs`` (sorted by arrival) until every request finished.
        ``time_schedule``: record each ``schedule`` call's queue length and host time.
        The cyclic garbage collector is off meanwhile: each step's burst of short-lived
        objects would make it walk the run's live requests again."""
        check_specs(specs, self.config)
        return self._play(_Run(self, specs, progress, time_schedule))

    def run_conversations(self, convs: Sequence[ConversationSpec],
                          progress: Callable[[int], None] | None = None) -> SimResult:
        """Simulate ``convs`` in closed loop until every turn finished; the result's
        ``requests`` are the turns in arrival order, ``turn_of`` names each one's."""
        check_conversations(convs, self.config)
        order = sorted(range(len(convs)), key=lambda ci: convs[ci].start_s)
        firsts = [dataclasses.replace(convs[ci].turns[0], arrival_s=convs[ci].start_s)
                  for ci in order]
        run = _Run(self, firsts, progress, conversations=convs, first_of=order)
        return self._play(run)

    @staticmethod
    def _play(run: _Run) -> SimResult:
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return run.play()
        finally:
            if was_enabled:
                gc.enable()


class _Run:
    """The state of one simulation (the scheduler and pages are fresh per run)."""

    def __init__(self, sim: Simulator, specs: Sequence[RequestSpec],
                 progress: Callable[[int], None] | None, time_schedule: bool = False,
                 conversations: Sequence[ConversationSpec] = (),
                 first_of: Sequence[int] = ()):
        cfg = sim.config
        self.cfg, self.cost, self.specs, self.progress = cfg, sim.cost, specs, progress
        # a cache only when some request has content: nothing else could hit
        self.prefix_caching = cfg.prefix_caching.enabled and (
            any(s.hash_ids is not None for s in specs)
            or any(t.hash_ids is not None for c in conversations for t in c.turns))
        # closed loop: a finished turn's next joins ``later`` (arrival, seq, conv, turn)
        self.conversations = conversations
        self.turn_of: dict[str, tuple[int, int]] = {}
        self.first_of = list(first_of)
        self.later: list[tuple[float, int, int, int]] = []
        self.num_added = self.num_pushed = 0
        self.kv = TwoTierKVManager(sim.num_device_pages, cfg.hardware.page_size, sim.num_host_pages,
                                   prefix_caching=self.prefix_caching,
                                   host_cache_eviction=cfg.prefix_caching.host_eviction,
                                   host_cache_max_pages=cfg.prefix_caching.host_max_pages)
        self.cache_key = isolation_key(f"sim:{sim.cost.name}", None) \
            if self.prefix_caching else None
        # FCFS never rotates: its shadows change no timeline unless copies cost the host
        # time, or a host cache keeps evicted pages findable through them
        copies_cost_host = sim.cost.host_s(1, 1) > sim.cost.host_s(1, 0)
        host_caching = self.prefix_caching and sim.num_host_pages > 0
        self.sched = make_scheduler(cfg, self.kv, sim.latency, page_bytes=sim.cost.page_bytes,
                                    shadowing=cfg.engine.policy != "fcfs" or copies_cost_host
                                    or host_caching)
        self.sim = sim
        self.link = Link(sim.cost)
        self.requests: dict[str, SimRequest] = {}
        self.order: list[SimRequest] = []
        self.copies: list[tuple[float, int, int, str]] = []  # heap (done, seq, dir, req_id)
        self.seq = 0
        self.num_steps = self.num_prefill = self.num_decode = self.shadow_pages = 0
        self.hit_pages_in = 0  # host -> device copies of host-tier prefix hits
        self.last_token = 0.0
        self.timing = (array("l"), array("d")) if time_schedule else None
        self.spec = None if sim.speculation is None else SpecState(sim.speculation)


    def play(self) -> SimResult:
        wall0 = time.perf_counter()
        specs, sched = self.specs, self.sched
        n, i = len(specs), 0
        t = specs[0].arrival_s if n else 0.0
        later = self.later
        while True:
            while True:  # arrivals up to t from both sources, in arrival order (a tie:
                # the spec first); ``later`` is empty in open loop
                if later and later[0][0] <= t and (i == n or later[0][0] < specs[i].arrival_s):
                    self._add_turn(*heapq.heappop(later))
                elif i < n and specs[i].arrival_s <= t:
                    self._add(specs[i], i)
                    i += 1
                else:
                    break
            self._observe_copies(t)
            if not sched.num_unfinished:
                if i == n and not later:
                    break
                t = self._next_arrival(i)
                continue
            if self.timing is None:
                plan = sched.schedule(t)
            else:
                plan = self._timed_schedule(t)
            num_pages = self._issue_copies(plan, t)
            if plan.is_empty:
                t = self._next_event(i)
                continue
            t = self._step(plan, t, num_pages)
        return self._result(wall0)

    def _timed_schedule(self, t: float) -> StepPlan:
        assert self.timing is not None
        queue, took = self.timing
        queue.append(len(self.sched.waiting))
        t0 = time.perf_counter()
        plan = self.sched.schedule(t)
        took.append(time.perf_counter() - t0)
        return plan

    def _next_arrival(self, i: int) -> float:
        """The next request's arrival: spec ``i``'s or the earliest next turn's."""
        nxt = self.specs[i].arrival_s if i < len(self.specs) else float("inf")
        if self.later:
            nxt = min(nxt, self.later[0][0])
        return nxt

    def _next_event(self, i: int) -> float:
        """When something can change after an empty plan: an arrival or a copy landing."""
        nxt = self._next_arrival(i)
        if self.copies:
            nxt = min(nxt, self.copies[0][0])
        if nxt == float("inf"):
            s = self.sched
            raise RuntimeError(
                f"simulation stuck: nothing can run and nothing will arrive or land "
                f"({len(s.waiting)} waiting, {len(s.running)} running, {len(s.rotary)} "
                f"rotary, {self.kv.num_free_pages} free device pages)")
        return nxt

    def _add(self, spec: RequestSpec, index: int) -> None:
        """Spec ``index`` arrives; request ids count the requests added."""
        req_id = str(self.num_added)
        if self.conversations:
            self.turn_of[req_id] = (self.first_of[index], 0)
        self._add_request(req_id, spec)

    def _add_turn(self, arrival_s: float, seq: int, conv: int, turn: int) -> None:
        """Turn ``turn`` of conversation ``conv`` arrives (its previous turn finished)."""
        req_id = str(self.num_added)
        self.turn_of[req_id] = (conv, turn)
        spec = dataclasses.replace(self.conversations[conv].turns[turn], arrival_s=arrival_s)
        self._add_request(req_id, spec)

    def _add_request(self, req_id: str, spec: RequestSpec) -> None:
        self.num_added += 1
        req = SimRequest(req_id, spec)
        if spec.hash_ids is not None:
            req.cache_key = self.cache_key  # hashed lazily by the scheduler's admission
        self.requests[req.req_id] = req
        self.order.append(req)
        if self.spec is not None:
            self.spec.add(req_id)
        self.sched.add(req)


    def _step(self, plan: StepPlan, t: float, num_pages: int) -> float:
        """Run the plan's two calls from ``t``; returns when the step ends."""
        reqs, cost = self.requests, self.cost
        self.num_steps += 1
        start = t
        started: list[SimRequest] = []
        t += cost.host_s(len(plan.prefill) + len(plan.decode), num_pages)
        if plan.prefill:
            rows = [(reqs[r], n) for r, n in plan.prefill]
            t += cost.prefill_call_s(CallShape.of_rows(
                [(n, q.num_computed_tokens) for q, n in rows]))
            self.num_prefill += sum(n for _, n in rows)
            self._advance(rows, t)
            if self.spec is not None:  # first tokens now: the decode call delays the next
                started = [q for q, _ in rows if q.num_output == 1 and not q.status.is_finished
                           and q.token_times[-1] == t]
        if plan.decode:
            drows = [reqs[r] for r in plan.decode]
            if self.spec is not None:
                return self._decode_speculative(drows, t, t - start, started)
            total = longest = 0  # contexts before the call; +1 after it
            for q in drows:  # summed here: a list of them would box every one
                c = q.num_computed_tokens
                total += c
                if c > longest:
                    longest = c
            num_rows = len(drows)
            total += num_rows
            t += cost.decode_call_s(CallShape(num_rows, 1, num_rows, total, total, longest + 1))
            self.num_decode += len(drows)
            self._advance_decode(drows, t)
        return t

    def _advance_decode(self, rows: list[SimRequest], now: float) -> None:
        """``_advance`` of decode rows (one token each; most rows are these)."""
        max_len = self.cfg.model.max_model_len
        for req in rows:
            req.num_computed_tokens += 1
            if req.num_computed_tokens < req.num_tokens:
                continue  # short of its last pending token, as ``_advance`` checks
            req.num_output += 1
            req.num_tokens += 1
            cast(list[float], req.token_times).append(now)  # a list until it finishes
            # at_length_limit(num_tokens - num_output, num_output, output_len, max_len)
            if req.num_output >= req.output_len or req.num_tokens >= max_len:
                self._finish(req, now)

    def _decode_speculative(self, rows: list[SimRequest], t: float, other_s: float,
                            started: list[SimRequest]) -> float:
        """The decode call from ``t`` with each row verifying ``1 + k`` tokens (``k`` from
        the policy, cut to the pages free); returns when it ends."""
        spec, kv = self.spec, self.kv
        assert spec is not None
        ks = spec.choose(rows, row_limits(rows, self.cfg.model.max_model_len), t, other_s,
                         self.cost, started)
        kept = []
        for j, q in enumerate(rows):  # pages for 1 + k, kept for the 1 + m accepted
            k = ks[j]
            while k and not kv.can_allocate(q.req_id, q.num_computed_tokens + 1 + k):
                k -= 1
            ks[j] = k
            m = spec.accepted(q.req_id, k) if k else 0
            spec.record(q.req_id, k, m)
            if m:
                kv.allocate_for(q.req_id, q.num_computed_tokens + 1 + m)
            kept.append(1 + m)
        t += self.cost.decode_call_s(decode_shape(rows, ks))
        self.num_decode += len(rows) + sum(ks)
        for q, n in zip(rows, kept, strict=True):
            q.num_computed_tokens += n
            q.num_output += n
            q.num_tokens += n
            cast(list[float], q.token_times).extend([t] * n)
            if q.num_output >= q.output_len or q.num_tokens >= self.cfg.model.max_model_len:
                self._finish(q, t)
        return t

    def _advance(self, rows: Iterable[tuple[SimRequest, int]], now: float) -> None:
        """The engine's ``_advance`` for each row: account ``n`` tokens of ``req``; the
        final row samples one. The length check is ``at_length_limit``, written out."""
        max_len = self.cfg.model.max_model_len
        for req, n in rows:
            req.num_computed_tokens += n
            if req.num_computed_tokens < req.num_tokens:
                continue  # a prefill chunk short of the end
            req.num_output += 1
            req.num_tokens += 1
            cast(list[float], req.token_times).append(now)  # a list until it finishes
            # at_length_limit(num_tokens - num_output, num_output, output_len, max_len)
            if req.num_output >= req.output_len or req.num_tokens >= max_len:
                self._finish(req, now)

    def _finish(self, req: SimRequest, now: float) -> None:
        """``req`` reached its length limit with the token landed at ``now``."""
        self.sched.remove(req)
        if self.spec is not None:
            self.spec.forget(req.req_id)
        req.block_hashes = []  # 16 bytes and a list slot a page: not kept after
        req.token_times = array("d", req.token_times)  # 8 bytes a token, not 32
        req.set_status(RequestStatus.FINISHED_LENGTH, now)
        self.last_token = max(self.last_token, now)
        if self.progress is not None:
            self.progress(1)
        if self.conversations:
            conv, turn = self.turn_of[req.req_id]
            c = self.conversations[conv]
            if turn + 1 < len(c.turns):
                heapq.heappush(self.later, (now + c.think_s[turn + 1], self.num_pushed,
                                            conv, turn + 1))
                self.num_pushed += 1


    def _issue_copies(self, plan: StepPlan, t: float) -> int:
        """Issue the plan's rotations and shadows; returns the number of pages."""
        shadows = plan.shadows
        if not (plan.moves_out or shadows or plan.moves_in):
            return 0
        num_shadow = sum(len(m) for m in shadows)
        self.shadow_pages += num_shadow
        out_pages = sum(len(m) for m in plan.moves_out) + num_shadow
        in_pages = sum(len(m) for m in plan.moves_in)
        if plan.moves_out or shadows:
            done = self.link.issue(OUT, out_pages, t, other_active=in_pages > 0)
            for m in plan.moves_out:
                self._push(done, OUT, m.req_id)
        if plan.moves_in:
            done = self.link.issue(IN, in_pages, t, other_active=out_pages > 0)
            for m in plan.moves_in:
                self._push(done, IN, m.req_id)
                if m.prefix_hit:  # lands like a rotate-in: the request runs from there
                    self.hit_pages_in += len(m)
        return out_pages + in_pages

    def _push(self, done: float, direction: int, req_id: str) -> None:
        heapq.heappush(self.copies, (done, self.seq, direction, req_id))
        self.seq += 1

    def _observe_copies(self, t: float) -> None:
        copies = self.copies
        if not copies or copies[0][0] > t:
            return
        landed = []
        while copies and copies[0][0] <= t:
            landed.append(heapq.heappop(copies))
        landed.sort(key=lambda c: (c[2], c[1]))  # outs first, then ins, in issue order
        for _, _, direction, req_id in landed:
            req = self.requests[req_id]
            if req.status.is_finished:
                continue
            if direction == OUT:
                self.kv.finish_rotate_out(req_id)
                self.sched.on_rotated_out(req, t)
            else:
                self.kv.finish_rotate_in(req_id)
                self.sched.on_rotated_in(req, t)

    def _prefix_counters(self) -> tuple[int, int, int]:
        """(prompt tokens looked up, found on the device, found on the host)."""
        cache, host = self.kv.prefix_cache, self.kv.host_cache
        if cache is None:
            return 0, 0, 0
        return cache.queries, cache.hits, 0 if host is None else host.hits

    def _result(self, wall0: float) -> SimResult:
        first = self.specs[0].arrival_s if self.specs else 0.0
        queries, device_hits, host_hits = self._prefix_counters()
        return SimResult(
            requests=self.order, duration_s=max(0.0, self.last_token - first),
            wall_s=time.perf_counter() - wall0, num_steps=self.num_steps,
            num_prefill_tokens=self.num_prefill, num_decode_tokens=self.num_decode,
            pages_out=self.link.pages[OUT], pages_in=self.link.pages[IN],
            shadow_pages=self.shadow_pages, link_busy_s=(self.link.busy_s[0], self.link.busy_s[1]),
            num_device_pages=self.sim.num_device_pages,
            num_host_pages=self.sim.num_host_pages, cost_name=self.cost.name,
            policy=self.cfg.engine.policy, prefix_caching=self.prefix_caching,
            prefix_cache_queries=queries, prefix_cache_device_hits=device_hits,
            prefix_cache_host_hits=host_hits, prefix_hit_pages_in=self.hit_pages_in,
            schedule_queue=self.timing[0] if self.timing else None,
            schedule_s=self.timing[1] if self.timing else None,
            turn_of=self.turn_of if self.conversations else None,
            speculation=None if self.spec is None else self.spec.summary())
