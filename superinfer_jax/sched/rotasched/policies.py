"""The built-in policies: ``fcfs`` (vLLM V1), ``swap`` (vLLM V0), ``rotasched``.

All three run through the same ``Scheduler`` stages and differ only in their decisions,
so a comparison between them measures the decision, not an implementation:

- ``fcfs``: never contended; a runner that needs a page preempts the most recent runner,
  which is recomputed later.
- ``swap``: ``fcfs`` whose victim is rotated out to the host (recomputed when the host is
  full); swapped requests come back before any new request is admitted.
- ``rotasched``: ``fcfs`` without memory contention. Contended, requests are ranked by
  virtual lag (or predicted slack), kept from the head while they fit in the device pool
  and the transfer budget, rotated out from the tail, and the step's tokens are sized to
  the decoders' tightest TBT SLO.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from superinfer_jax.config import EngineConfig, bucket
from superinfer_jax.kv.two_tier import TwoTierKVManager
from superinfer_jax.mypyc_build import mypyc_attr
from superinfer_jax.request import ROTARY, RUNNING, Request
from superinfer_jax.sched.rotasched.lag import virtual_lag
from superinfer_jax.sched.rotasched.policy import HOST, Policy
from superinfer_jax.sched.rotasched.ranking import (
    deferred_hopeless,
    first_token_slack,
    is_overdue,
    is_protected,
    late_window,
    missed_ttft,
    rank_by_lag,
    reply_due_on_time,
    residency_window,
    timed_window,
)
from superinfer_jax.sched.selection import Ranking
from superinfer_jax.sched.step_plan import StepBudget

if TYPE_CHECKING:
    from superinfer_jax.sched.scheduler import Scheduler

__all__ = ["FCFSPolicy", "RotaSchedPolicy", "SwapPolicy"]


# no class decorator (mypyc: a decorated class is not native): ``registry`` names them
@mypyc_attr(allow_interpreted_subclasses=True)
class FCFSPolicy(Policy):
    """vLLM V1: never contended; a victim is recomputed."""


@mypyc_attr(allow_interpreted_subclasses=True)
class SwapPolicy(FCFSPolicy):
    """vLLM V0 swap preemption: the victim's KV goes to host memory, not away."""

    def evict_to(self, s: Scheduler, req: Request) -> str:
        return HOST


@mypyc_attr(allow_interpreted_subclasses=True)
class RotaSchedPolicy(SwapPolicy):
    """Lag (or slack) ranking and a TBT-sized token budget under contention; else FCFS."""

    uses_latency = True  # mode "slack" and the TBT-sized token budget

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.params = config.rotasched


    def contended(self, s: Scheduler) -> bool:
        """Above the high-water mark, anyone parked or rotating, or (a seat rule,
        ``seat_limit``) someone waiting for a seat, so the ranking decides who takes the
        seats; never without a host tier."""
        if not isinstance(s.kv, TwoTierKVManager):
            return False
        used, usable = s.device_pages_in_use()
        return bool(s.rotary) or used >= self.params.high_water_mark * usable or (
            s.seat_cap < self.config.engine.max_num_seqs and bool(s.waiting)
            and s._num_seated() >= s.seat_cap)

    def seat_limit(self, s: Scheduler) -> int:
        """``max_num_seqs``, and at most the seats of two rules (unset: off), whichever binds
        first: ``step_slo_fraction`` (with a latency model) the seats whose modelled decode
        call (each at the runners' mean context) plus the smallest prefill chunk fits in
        that share of the runners' tightest TBT SLO; ``pool_seat_fraction`` that share of
        the seats the usable device pages hold at the runners' mean context plus their
        output so far (a reply is expected to grow by as much again). With nobody running
        the waiting head stands in. Never fewer than are seated now: the rules refuse new
        seats and evict nobody (a refused request stays waiting or parked; the ranking
        decides who takes a free seat, ``contended``)."""
        most = self.config.engine.max_num_seqs
        fraction = self.params.step_slo_fraction
        pool_share = self.params.pool_seat_fraction
        lm = s.latency
        if (pool_share is None and (fraction is None or lm is None)) or not (
                s.running or s.waiting):
            return most
        seated = s.running or [s.waiting.first()]
        tbt_ms = context = grown = 0.0
        for r in seated:
            if not tbt_ms or r.slo.tbt_ms < tbt_ms:
                tbt_ms = r.slo.tbt_ms
            n = r.num_tokens
            context += n
            grown += n - len(r.prompt_token_ids)
        limit = most
        if fraction is not None and lm is not None:
            d0, d1, d2 = lm.decode
            per_seat = d1 + d2 * context / len(seated)
            room = fraction * tbt_ms / 1000 - d0 - lm.prefill_s(
                self.config.prefill_chunk_buckets[0])
            if per_seat > 0:
                limit = int(max(0.0, room) / per_seat)
        if pool_share is not None:
            pages = (context + grown) / len(seated) / self.config.hardware.page_size
            limit = min(limit, int(pool_share * s.kv.allocator.num_usable / max(1.0, pages)))
        return min(most, max(s._num_seated(), limit))

    def parked_page_limit(self, s: Scheduler) -> int | None:
        """``parked_share`` of the usable device pages (None at 1: no limit), and with
        ``parked_return_steps`` at most the pages that many steps' inbound transfer budget
        brings back: parking more replies than the pool or the link can take back in time
        turns each rotation into a long gap."""
        share = self.params.parked_share
        limit = None if share >= 1 else int(share * s.kv.allocator.num_usable)
        steps = self.params.parked_return_steps
        if steps is None:
            return limit
        pages = int(steps * self.config.duplex_kv.transfer_budget_pages)
        return pages if limit is None else min(limit, pages)


    def token_budget(self, s: Scheduler, budget: StepBudget, now: float,
                     keep: set[str]) -> StepBudget:
        """Decode rows plus the largest prefill chunk bucket whose padded call keeps the
        step within the decoders' tightest TBT SLO (Sarathi-style). The configured budget
        without a model or decoders, while a late first token that can still make it
        prefills, or while memory keeps nobody waiting (it would only delay first tokens).
        With ``prefill_stall_cap``, a late first token's step and one whose decode call
        alone misses the TBT take the largest chunk that keeps the step within that many
        TBT SLOs (at least the smallest bucket)."""
        # one pass over the runners: the decoders' count, tightest TBT and longest context
        num_decoders = longest = 0
        tbt_ms = 0.0
        prefilling: list[Request] = []  # a prompt (or a recomputation) left
        for r in s.running:  # ``Request.num_pending_tokens`` inlined
            pending = 0 if r.final_token_inflight else r.num_tokens - r.num_computed_tokens
            if pending == 1:
                ms, n = r.slo.tbt_ms, r.num_tokens
                if not num_decoders or ms < tbt_ms:
                    tbt_ms = ms
                if n > longest:
                    longest = n
                num_decoders += 1
            elif pending > 1:
                prefilling.append(r)
        lm = s.latency
        if lm is None or not num_decoders or self._nobody_waits_for_memory(s, keep):
            return budget
        cap = self.params.prefill_stall_cap
        late = self._first_token_late(s, now, keep, prefilling)
        if late and cap is None:
            return budget
        tbt = tbt_ms / 1000  # the same float as ``slo.tbt_s`` of the tightest decoder
        # the decode call as compiled: padded rows, each walking the longest context
        rows = bucket(num_decoders, self.config.decode_buckets)
        decode_s = lm.decode_s(rows, rows * longest)
        context = 0
        for r in prefilling:
            if r.num_computed_tokens > context:
                context = r.num_computed_tokens
        chunks = self.config.prefill_chunk_buckets
        room = 0.9 * tbt - decode_s
        fits = [] if late else [c for c in chunks if lm.prefill_s(c, context) <= room]
        if not fits and cap is not None:  # the TBT is missed: the miss lasts <= cap SLOs
            room = cap * tbt - decode_s
            # up to ``prefill_rows`` rows of the largest chunk, within the configured budget
            most = budget.tokens - num_decoders
            sizes = [c for c in chunks + tuple(chunks[-1] * n for n in range(
                2, budget.limits.prefill_rows + 1)) if c <= most] or [chunks[0]]
            fits = [c for c in sizes if lm.prefill_s(c, context) <= room] or sizes[:1]
        if not fits:  # the step misses the TBT anyway: let the miss buy the most progress
            return budget
        return StepBudget(num_decoders + fits[-1], fits[-1], budget.pages_out,
                          budget.pages_in, budget.limits)

    @staticmethod
    def _nobody_waits_for_memory(s: Scheduler, keep: set[str]) -> bool:
        """Nothing parked or rotating, and every waiting request selected to run."""
        return not s.rotary and len(s.waiting) <= len(keep) and all(
            r.req_id in keep for r in s.waiting)

    def _first_token_late(self, s: Scheduler, now: float, keep: set[str],
                          prefilling: list[Request]) -> bool:
        """Whether a request that prefills this step (running, or waiting and kept) has a
        late first token it can still make (``late_order: shortest`` prices its prefill)."""
        beta = self.params.beta_f
        priced = self.params.late_order == "shortest" and s.latency is not None
        return any(_late_first_token(r, now, beta) and _may_make_it(s, r, now, priced)
                   for r in prefilling) or any(
            _late_first_token(r, now, beta) and _may_make_it(s, r, now, priced)
            for _, _, r in late_window(s.waiting, now, beta) if r.req_id in keep)


    def urgency(self, s: Scheduler, req: Request, now: float) -> float:
        """Larger is more urgent: virtual lag, or negated (weighted) predicted slack."""
        if self.params.mode == "vlt":
            return virtual_lag(req, now, self.params)
        slack = self.predicted_slack(s, req, now)
        weight = self.params.priority_weights[req.slo.priority_class]
        return -(slack / weight if slack > 0 else slack * weight)

    def predicted_slack(self, s: Scheduler, req: Request, now: float) -> float:
        """Seconds to spare before the next deadline, after the predicted work to meet it."""
        lm = s.latency
        if lm is None:
            raise RuntimeError("rotasched.mode 'slack' needs a latency model; warm up the "
                               "engine or give rotasched.latency_profile")
        if not req.token_times:
            return first_token_slack(s, req, now)
        work = lm.decode_s(max(1, len(s.running)), req.num_tokens)
        if req.status != RUNNING:
            pages = s.kv.page_table(req.req_id) or []
            work += lm.transfer_s(len(pages) * s.page_bytes) if pages else 0.0
        return req.token_times[-1] + req.slo.tbt_s - now - work

    def rank(self, s: Scheduler, now: float) -> Iterable[Request]:
        """Every request that could run, most urgent first (ties: arrival order), in the
        groups of ``ranking``'s docstring; FCFS order when no one is late. Mode ``vlt``
        ranks incrementally (``rank_by_lag``); mode ``slack`` sorts every candidate each
        contended step, as its key changes with the cache and the batch."""
        if self.params.mode == "vlt":
            return rank_by_lag(s, now, self.params)
        return self._rank_by_slack(s, now)

    def _rank_by_slack(self, s: Scheduler, now: float) -> Iterable[Request]:
        k = self.params.min_residency_tokens
        slos = self.params.residency_tbt_slos
        hopeless_last = self.params.hopeless_last
        cap = self.params.hopeless_wait_cap
        replies = self.params.parked_replies
        lm = s.latency  # a decode step (``reply_due_on_time``, ``residency_tbt_slos``)
        step_s = None if lm is None or (replies == "lag" and slos is None) else lm.decode_s(
            max(1, len(s.running)), sum(r.num_tokens for r in s.running))
        free_only: set[int] = set()
        overdue = self.params.overdue_wait_cap

        # (group, place in group 1, value, arrival)
        def key(r: Request) -> tuple[int, float, float, float]:
            urgency = self.urgency(s, r, now)
            if r.status == RUNNING:
                kr = k if slos is None or step_s is None else timed_window(
                    k, slos / step_s * r.slo.tbt_s)
                if is_protected(r, residency_window(r, kr, self.params.residency_share)):
                    return (0, 0, 0.0, r.arrival_time)  # protected, oldest first
                return (1, 2, -urgency, r.arrival_time)
            if replies != "lag" and r.token_times and r.status == ROTARY:
                lag = virtual_lag(r, now, self.params)
                if reply_due_on_time(s, r, now, step_s, self.params):
                    return (1, 0, -urgency, r.arrival_time)  # must start back now
                if lag > 0:  # parked past ``beta_b`` of a gap: displaces by urgency
                    return (1, 2, -urgency, r.arrival_time)
                free_only.add(id(r))  # free pages only, ahead of late first tokens
                return (1, 1, -urgency, r.arrival_time)
            if overdue is not None and is_overdue(r, now, overdue):
                return (1, 1.5, 0.0, r.arrival_time)  # waited past the cap: by arrival
            missed = missed_ttft(r, now)
            if urgency > 0 and not missed:
                return (1, 2, -urgency, r.arrival_time)  # late: may displace runners
            if missed and hopeless_last and deferred_hopeless(r, now, cap):
                return (3, 0, 0.0, r.arrival_time)  # hopeless, behind those who can make it
            return (2, 0, 0.0, r.arrival_time)  # not late, or hopeless: FCFS behind runners

        ranked = sorted(s.candidates(), key=key)
        if not free_only:
            return ranked
        return Ranking(ranked, s, {id(r) for r in ranked if r.status != RUNNING},
                       free_only=free_only)


def _may_make_it(s: Scheduler, r: Request, now: float, priced: bool) -> bool:
    """Unpriced, always; priced, whether ``r``'s own prefill can end by its deadline."""
    return not priced or first_token_slack(s, r, now) >= 0


def _late_first_token(r: Request, now: float, beta: float) -> bool:
    """No first token yet, past ``beta`` of its TTFT budget, and not past the budget."""
    # ``beta * ttft_ms / 1000``, not ``beta * ttft_s``: the float ``late_window`` uses
    return (not r.token_times and now - r.arrival_time > beta * r.slo.ttft_ms / 1000
            and not missed_ttft(r, now))
