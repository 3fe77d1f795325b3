"""Scheduling policies over one seam: ``fcfs`` (vLLM V1), ``swap`` (vLLM V0), ``rotasched``.

All three are the FCFS scheduler with one or two decisions changed, so a comparison
between them measures the decision, not an implementation difference:

- ``fcfs``: when a running request needs a page and none is free, the most recently
  admitted running request is preempted and later recomputed.
- ``swap``: the same victim is swapped out to host memory instead (rotated out, falling
  back to recomputation when the host tier is full), and swapped requests come back
  before any new request is admitted.
- ``rotasched``: with no memory contention, exactly ``fcfs``. Under contention (device
  pages above the high-water mark, or requests parked on the host) every request is
  ranked by virtual lag (or by predicted slack), requests are kept or brought onto the
  device from the head while they fit in the device pool and the step's transfer budget,
  and running requests are rotated out from the tail, before an allocation fails.
"""

from __future__ import annotations

import bisect
import time

from superinfer_jax.config import EngineConfig, bucket
from superinfer_jax.kv.two_tier import TwoTierKVManager
from superinfer_jax.latency import LatencyModel
from superinfer_jax.request import Request, RequestStatus
from superinfer_jax.rotasched.lag import virtual_lag
from superinfer_jax.scheduler import FCFSScheduler, StepPlan


class SwapScheduler(FCFSScheduler):
    """vLLM V0 swap preemption: the victim's KV goes to host memory, not away."""

    def _evict(self, req: Request, plan: StepPlan, now: float) -> None:
        self._rotate_out(req, plan, now)


class RotaSchedScheduler(SwapScheduler):
    def __init__(self, config: EngineConfig, kv: TwoTierKVManager,
                 latency: LatencyModel | None = None):
        super().__init__(config, kv)
        self.params = config.rotasched
        self.latency = latency  # needed by mode "slack"; the engine sets it at warm-up

    # -- when to act ----------------------------------------------------------------------

    def contended(self) -> bool:
        """Proactive trigger: above the high-water mark, or anyone parked or rotating."""
        usable = self.kv.allocator.num_usable
        used = usable - self.kv.num_free_pages
        return bool(self.rotary) or used >= self.config.rotasched.high_water_mark * usable

    def schedule(self, now: float | None = None) -> StepPlan:
        now = time.perf_counter() if now is None else now
        if not self.contended():
            return super().schedule(now)
        plan = StepPlan()
        self._rotate_forced(plan, now)
        ranked = self.rank(now)
        keep = self._select(ranked)
        self._rotate_out_tail(ranked, keep, plan, now)
        budget, self.prefill_slots = self._token_budget(now, keep)
        budget = self._schedule_running(plan, budget, now)
        self._rotate_in_ranked(ranked, keep, plan, now)
        self._admit_ranked(ranked, keep, plan, budget, now)
        return plan

    def _schedule_running(self, plan: StepPlan, budget: int, now: float) -> int:
        """Decode rows first, then prefill chunks with what is left: under a TBT-sized
        budget a prefill early in the list must not crowd out a decoder behind it."""
        decoding = [r for r in self.running if r.num_pending_tokens == 1]
        prefilling = [r for r in self.running if r.num_pending_tokens > 1]
        ending = [r for r in self.running if r.num_pending_tokens == 0]  # token in flight
        order, self.running = self.running, decoding + prefilling + ending
        try:
            return super()._schedule_running(plan, budget, now)
        finally:
            kept = set(map(id, self.running))  # admission order, minus this step's victims
            self.running = [r for r in order if id(r) in kept]

    def _token_budget(self, now: float, keep: set[str]) -> tuple[int, int]:
        """(tokens, padded prefill slots) this step may take: decode rows plus the largest
        prefill chunk bucket whose call keeps the step within the tightest TBT SLO among
        the decoders (Sarathi-style), priced by the latency model at the padded shape the
        engine will run, fixed cost of the prefill call included (pricing real tokens
        only, 23 planned tokens ran as a 64-column call of 88 ms against a 54 ms SLO).

        Without a model, with nobody decoding, or while a first token that can still make
        its deadline is late and will prefill this step, the configured budget: the lag
        order puts a late first token ahead of the runners' next ones, and a TBT-sized
        budget would starve prefill (measured on the policy sweep at 3 req/s: TTFT
        attainment 0.27 with it, 0.98 without it while someone is late)."""
        full = (self.config.max_num_batched_tokens,) * 2
        decoders = [r for r in self.running if r.num_pending_tokens == 1]
        lm = self.latency
        if lm is None or not decoders or self._first_token_late(now, keep):
            return full
        tbt = min(r.slo.tbt_ms for r in decoders) / 1000
        # the decode call as compiled: rows padded to a bucket, every row walking the
        # longest context (XLA attention; an upper bound for the Pallas kernel)
        rows = bucket(len(decoders), self.config.decode_buckets)
        room = 0.9 * tbt - lm.decode_s(rows, rows * max(r.num_tokens for r in decoders))
        context = max((r.num_computed_tokens for r in self.running
                       if r.num_pending_tokens > 1), default=0)
        fits = [c for c in self.config.prefill_chunk_buckets
                if lm.prefill_s(c, context) <= room]
        if not fits:
            # No chunk fits: any prefill makes this step miss the decoders' TBT anyway,
            # so let the miss buy the most progress. Trickling a floor of tokens instead
            # spread the misses over many steps (measured at 4 req/s on the policy sweep:
            # TBT attainment 0.77 with the floor, 0.80 without).
            return full
        return len(decoders) + fits[-1], fits[-1]

    def _first_token_late(self, now: float, keep: set[str]) -> bool:
        """Whether a first token is late (past ``beta_f`` of its TTFT SLO, where the
        waiting lag starts to grow) but not yet missed, for a request that prefills this
        step: running with a prompt left, or waiting and selected to run. A hopeless or
        unselected request would not get the tokens, and the decoders would pay."""
        beta = self.params.beta_f

        def late(r: Request) -> bool:
            return (not r.token_times and now - r.arrival_time > beta * r.slo.ttft_ms / 1000
                    and not _missed_ttft(r, now))

        return any(late(r) for r in self.running if r.num_pending_tokens > 1) or any(
            late(r) for r in self.waiting if r.req_id in keep)

    # -- ranking --------------------------------------------------------------------------

    def urgency(self, req: Request, now: float) -> float:
        """Larger is more urgent: virtual lag, or negated (weighted) predicted slack."""
        if self.config.rotasched.mode == "vlt":
            return virtual_lag(req, now, self.params)
        slack = self.predicted_slack(req, now)
        weight = self.params.priority_weights[req.slo.priority_class]
        return -(slack / weight if slack > 0 else slack * weight)

    def predicted_slack(self, req: Request, now: float) -> float:
        """Seconds to spare before the next deadline, after the predicted work to meet it."""
        lm = self.latency
        if lm is None:
            raise RuntimeError("rotasched.mode 'slack' needs a latency model; warm up the "
                               "engine or give rotasched.latency_profile")
        if not req.token_times:
            work = lm.prefill_s(req.num_pending_tokens, req.num_computed_tokens)
            return req.arrival_time + req.slo.ttft_ms / 1000 - now - work
        work = lm.decode_s(max(1, len(self.running)), req.num_tokens)
        if req.status != RequestStatus.RUNNING:
            pages = self.kv.page_table(req.req_id) or []
            work += lm.transfer_s(len(pages) * self.page_bytes) if pages else 0.0
        return req.token_times[-1] + req.slo.tbt_ms / 1000 - now - work

    def rank(self, now: float) -> list[Request]:
        """Every request that could run, most urgent first (ties: arrival order).

        Three guards keep rotation productive:
        - a running request that has produced fewer than ``min_residency_tokens`` since it
          was admitted or rotated in, or is within that many tokens of its ``max_tokens``
          (or whose token in flight ends it), ranks first: evicting it moves pages for
          little progress (two requests could swap places every step forever, a
          livelock), or for pages it frees by itself within a few steps, and every
          rotation of a decoding request costs it a TBT miss (calibrated simulator, 16
          seeds at the knee: rotations 53 -> 32, TBT attainment +1.1 points, TTFT +0.5);
        - a waiting or parked request that is not late (lag 0) ranks after the running
          ones: it may take free pages, but only a late request displaces a runner;
        - so does a waiting request already past its TTFT deadline: the miss is certain,
          and displacing a runner for it would only add a TBT miss. Capacity goes to
          requests that can still make their deadline (in simulation at overload this
          raised both TTFT and TBT attainment; see ``benchmarks.policy_sweep``).
        With no one late this is FCFS order, whatever the memory pressure."""
        parked = [r for r in self.rotary if r.status == RequestStatus.ROTARY]
        pool = list(self.waiting) + parked + list(self.running)
        k = self.params.min_residency_tokens

        def key(r: Request) -> tuple[int, float, float]:
            urgency = self.urgency(r, now)
            if r.status == RequestStatus.RUNNING:
                if _resident_tokens(r) < k or r.max_tokens_left <= k or r.final_token_inflight:
                    return (0, 0.0, r.arrival_time)  # protected, oldest first
                return (1, -urgency, r.arrival_time)
            if urgency > 0 and not _missed_ttft(r, now):
                return (1, -urgency, r.arrival_time)  # late: may displace runners
            return (2, 0.0, r.arrival_time)  # not late, or hopeless: FCFS behind runners

        return sorted(pool, key=key)

    # -- selection ------------------------------------------------------------------------

    def _pages_to_run(self, req: Request) -> int:
        """Device pages ``req`` holds after its next step (its next chunk included)."""
        chunk = 1 if req.num_pending_tokens == 1 else min(req.num_pending_tokens,
                                                          self.config.max_prefill_chunk)
        return -(-(req.num_computed_tokens + chunk) // self.kv.page_size)

    def _select(self, ranked: list[Request]) -> set[str]:
        """From the head: who fits in the device pool and the inbound transfer budget.

        Capacity is what the running requests hold plus what is free: pages of requests
        rotating in are spoken for, pages of requests rotating out are already free."""
        capacity = self.kv.num_free_pages + sum(len(self.kv.page_table(r.req_id))
                                                for r in self.running)
        transfer = self.config.transfer_budget_pages
        used, seats, keep = 0, self.config.max_num_seqs - self._num_rotating_in(), set()
        for req in ranked:
            need = self._pages_to_run(req)
            moving = self._host_pages(req)
            if len(keep) >= seats or used + need > capacity or moving > transfer:
                continue
            keep.add(req.req_id)
            used += need
            transfer -= moving
        return keep

    def _host_pages(self, req: Request) -> int:
        """Pages ``req`` must move in before it can run (0 unless parked)."""
        if req.status == RequestStatus.ROTARY:
            return self.kv.rotation_cost_in(req.req_id)
        return 0

    def _rotate_out_tail(self, ranked: list[Request], keep: set[str], plan: StepPlan,
                         now: float) -> None:
        budget = self.config.transfer_budget_pages
        for req in reversed(ranked):
            if req.status != RequestStatus.RUNNING or req.req_id in keep:
                continue
            cost = self.kv.rotation_cost_out(req.req_id)
            if cost > budget:
                continue
            budget -= cost
            self._evict(req, plan, now)

    def _rotate_in_ranked(self, ranked: list[Request], keep: set[str], plan: StepPlan,
                          now: float) -> None:
        budget = self.config.transfer_budget_pages
        for req in ranked:
            if req.status != RequestStatus.ROTARY or req.req_id not in keep:
                continue
            cost = self._host_pages(req)
            if self._num_seated() >= self.config.max_num_seqs:
                break
            if cost > budget or not self.kv.can_rotate_in(req.req_id):
                continue
            self._rotate_in(req, plan, now)
            budget -= cost

    def _admit_ranked(self, ranked: list[Request], keep: set[str], plan: StepPlan,
                      budget: int, now: float) -> None:
        for req in ranked:
            if req.status != RequestStatus.WAITING or req.req_id not in keep or budget <= 0:
                continue
            if req.req_id in plan.preempted or self._num_seated() >= self.config.max_num_seqs:
                continue
            budget -= self._admit_one(req, plan, budget, now)


def _missed_ttft(req: Request, now: float) -> bool:
    """A request without a first token whose TTFT deadline has passed."""
    return not req.token_times and now - req.arrival_time > req.slo.ttft_ms / 1000


def _resident_tokens(req: Request) -> int:
    """Tokens produced since the request last started running (admitted or rotated in)."""
    if req.running_since is None:
        return 0
    return len(req.token_times) - bisect.bisect_left(req.token_times, req.running_since)


def make_scheduler(config: EngineConfig, kv: TwoTierKVManager,
                   latency: LatencyModel | None = None) -> FCFSScheduler:
    if config.policy == "fcfs":
        return FCFSScheduler(config, kv)
    if config.policy == "swap":
        return SwapScheduler(config, kv)
    return RotaSchedScheduler(config, kv, latency)
