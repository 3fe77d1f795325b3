"""The built-in policies: ``fcfs`` (vLLM V1), ``swap`` (vLLM V0), ``rotasched``.

All three run through the same ``Scheduler`` stages and differ only in their decisions
(``policy.Policy``), so a comparison between them measures the decision, not an
implementation difference:

- ``fcfs``: never contended; when a running request needs a page and none is free, the
  most recently admitted running request is preempted and later recomputed.
- ``swap``: ``fcfs`` whose victim is swapped out to host memory instead (rotated out,
  falling back to recomputation when the host tier is full); swapped requests come back
  before any new request is admitted.
- ``rotasched``: with no memory contention, exactly ``fcfs``. Contended (device pages
  above the high-water mark, or requests parked on the host), every request is ranked by
  virtual lag (or by predicted slack), requests are kept or brought onto the device from
  the head while they fit in the device pool and the step's transfer budget (a waiting
  request's prefix hit needs only the pages past it, and its host-tier part a transfer;
  slack mode prices both), running
  requests are rotated out from the tail before an allocation fails, and the step's
  tokens are sized to the decoders' tightest TBT SLO.
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
    first_token_slack,
    is_protected,
    late_window,
    missed_ttft,
    rank_by_lag,
    reply_due_on_time,
    residency_window,
)
from superinfer_jax.sched.selection import Ranking
from superinfer_jax.sched.step_plan import StepBudget

if TYPE_CHECKING:
    from superinfer_jax.sched.scheduler import Scheduler

__all__ = ["FCFSPolicy", "RotaSchedPolicy", "SwapPolicy"]


# Named in ``registry``'s table, not by a class decorator: compiled with mypyc, a decorated
# class is a plain Python class, and native classes cannot extend one.
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
    """The paper's policy: lag (or slack) ranking and a TBT-sized token budget, under
    contention; FCFS otherwise."""

    uses_latency = True  # mode "slack" and the TBT-sized token budget

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.params = config.rotasched

    # -- when to act ----------------------------------------------------------------------

    def contended(self, s: Scheduler) -> bool:
        """Proactive trigger: above the high-water mark, or anyone parked or rotating.
        Never on a one-tier page manager (no host tier to park a request in: FCFS; the
        engine's is always two-tier, some tests drive the scheduler with a plain one)."""
        if not isinstance(s.kv, TwoTierKVManager):
            return False
        used, usable = s.device_pages_in_use()
        return bool(s.rotary) or used >= self.params.high_water_mark * usable

    def parked_page_limit(self, s: Scheduler) -> int | None:
        """``parked_share`` of the usable device pages (None at 1: no limit). A parked
        reply's next token is due a TBT SLO after its last one, and it can only come back
        into pages the runners free: parking more replies than the pool can take back in
        time turns each rotation into a long gap (see ``RotaSchedConfig.parked_share``)."""
        share = self.params.parked_share
        return None if share >= 1 else int(share * s.kv.allocator.num_usable)

    # -- the step's token budget ----------------------------------------------------------

    def token_budget(self, s: Scheduler, budget: StepBudget, now: float,
                     keep: set[str]) -> StepBudget:
        """Decode rows plus the largest prefill chunk bucket whose call keeps the step
        within the tightest TBT SLO among the decoders (Sarathi-style), priced by the
        latency model at the padded shape the engine will run, fixed cost of the prefill
        call included (pricing real tokens only, 23 planned tokens ran as a 64-column
        call of 88 ms against a 54 ms SLO).

        Without a model, with nobody decoding, or while a first token that can still make
        its deadline is late and will prefill this step, the configured budget: the lag
        order puts a late first token ahead of the runners' next ones, and a TBT-sized
        budget would starve prefill (measured on the policy sweep at 3 req/s: TTFT
        attainment 0.27 with it, 0.98 without it while someone is late).

        Nor while memory keeps nobody waiting (nothing parked or rotating, and the
        selection kept every waiting request): above the high-water mark but with room
        for everyone, holding prefill back only delays first tokens, which fcfs would
        not (paper-qwen32b-sharegpt on gh200-96g at 10 req/s, no rotations: mean TTFT
        293 ms against fcfs's 124, P99 2.6 s against 0.58 s, for +0.4 points of TBT)."""
        # One pass over the runners (every contended step), each pending count read once;
        # of the decoders only their count, tightest TBT and longest context are needed.
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
        if lm is None or not num_decoders or self._nobody_waits_for_memory(s, keep) \
                or self._first_token_late(s, now, keep, prefilling):
            return budget
        # the decoders' tightest ``slo.tbt_s`` without a property call each: ``tbt_s`` is
        # ``tbt_ms / 1000``, and a rounded division by 1000 keeps the order, so the same float
        tbt = tbt_ms / 1000
        # the decode call as compiled: rows padded to a bucket, every row walking the
        # longest context (XLA attention; an upper bound for the Pallas kernel)
        rows = bucket(num_decoders, self.config.decode_buckets)
        room = 0.9 * tbt - lm.decode_s(rows, rows * longest)
        context = 0
        for r in prefilling:
            if r.num_computed_tokens > context:
                context = r.num_computed_tokens
        fits = [c for c in self.config.prefill_chunk_buckets
                if lm.prefill_s(c, context) <= room]
        if not fits:
            # No chunk fits: any prefill makes this step miss the decoders' TBT anyway,
            # so let the miss buy the most progress. Trickling a floor of tokens instead
            # spread the misses over many steps (measured at 4 req/s on the policy sweep:
            # TBT attainment 0.77 with the floor, 0.80 without).
            return budget
        # the constructor, not ``dataclasses.replace`` (an interpreted call, every step)
        return StepBudget(num_decoders + fits[-1], fits[-1], budget.pages_out,
                          budget.pages_in, budget.limits)

    @staticmethod
    def _nobody_waits_for_memory(s: Scheduler, keep: set[str]) -> bool:
        """Nothing parked or rotating, and every waiting request selected to run (counted
        first: a queue longer than the selection is not all kept)."""
        return not s.rotary and len(s.waiting) <= len(keep) and all(
            r.req_id in keep for r in s.waiting)

    def _first_token_late(self, s: Scheduler, now: float, keep: set[str],
                          prefilling: list[Request]) -> bool:
        """Whether a first token is late (past ``beta_f`` of its TTFT SLO, where the
        waiting lag starts to grow) but not yet missed, for a request that prefills this
        step: running with a prompt left (``prefilling``, in running order), or waiting and
        selected to run. A hopeless or unselected request would not get the tokens, and
        the decoders would pay; nor, with ``late_order: shortest``, one whose own prefill
        cannot end by its deadline (``first_token_slack`` < 0): its miss is as certain."""
        beta = self.params.beta_f
        priced = self.params.late_order == "shortest" and s.latency is not None
        # a late waiting request lies in the queue's late window (``ranking.late_window``)
        return any(_late_first_token(r, now, beta) and _may_make_it(s, r, now, priced)
                   for r in prefilling) or any(
            _late_first_token(r, now, beta) and _may_make_it(s, r, now, priced)
            for _, _, r in late_window(s.waiting, now, beta) if r.req_id in keep)

    # -- ranking --------------------------------------------------------------------------

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
        """Every request that could run, most urgent first (ties: arrival order).

        Five rules keep rotation productive and meet the most deadlines:
        - a running request that has produced fewer than ``min_residency_tokens`` since it
          was admitted or rotated in, or is within that many tokens of its ``max_tokens``
          (or whose token in flight ends it), ranks first (each window at most
          ``residency_share`` of its ``max_tokens``: 16-token windows at both ends would
          never let a reply of at most 32 tokens, the multi-turn sweep's, rotate out, and
          RotaSched would be FCFS there): evicting it moves pages for
          little progress (two requests could swap places every step forever, a
          livelock), or for pages it frees by itself within a few steps, and every
          rotation of a decoding request costs it a TBT miss (calibrated simulator, 16
          seeds at the knee: rotations 53 -> 32, TBT attainment +1.1 points, TTFT +0.5);
        - a parked request whose rotate-in is due (its copy in and a step, priced by the
          latency model, would end past its next token's deadline) ranks right after
          the protected runners, ahead of late first tokens: it comes back before its
          next token is due, where ranking it among them by lag left it parked for a
          median 229 ms (P99 TBT 1.85x fcfs's at the GH200 knee; ``ranking``); a
          parked reply (``parked_replies`` other than ``lag``) ranks there only while it
          must start back now to be on time and still can: once its next token is late
          anyway, displacing a runner for it only makes the runner's next token late
          too, so until it lags (``beta_b``) it takes only pages no runner needs, ahead
          of late first tokens (``free_pages``);
        - a waiting or parked request that is not late (lag 0) ranks after the running
          ones (but for the parked replies of ``free_pages``, above): it may take free
          pages, but only a late request displaces a runner;
        - so does a waiting request already past its TTFT deadline: the miss is certain,
          and displacing a runner for it would only add a TBT miss. Capacity goes to
          requests that can still make their deadline (in simulation at overload this
          raised both TTFT and TBT attainment; see ``benchmarks.policy_sweep``).
        - with ``late_order: shortest`` (the default, mode ``vlt``), the late first
          tokens displace runners fewest tokens (over priority weight) first, and one
          whose own prefill cannot end by its deadline does not displace anyone: under
          overload, deadline order let the long prompts' queue waits make the short ones
          miss too (``RotaSchedConfig.late_order``).
        With no one late this is FCFS order, whatever the memory pressure.

        Mode ``vlt`` ranks incrementally (``ranking.rank_by_lag``: the same order, from
        structures whose cost does not grow with the queue, read lazily from the head).
        Mode ``slack`` sorts every candidate each contended step: its key prices each
        request's work with the latency model and its prefix-cache hit, which change with
        the cache and the batch, so there is no order to keep between steps."""
        if self.params.mode == "vlt":
            return rank_by_lag(s, now, self.params)
        k = self.params.min_residency_tokens
        hopeless_last = self.params.hopeless_last
        replies = self.params.parked_replies
        lm = s.latency  # a decode step over the runners (``reply_due_on_time``)
        step_s = None if lm is None or replies == "lag" else lm.decode_s(
            max(1, len(s.running)), sum(r.num_tokens for r in s.running))
        free_only: set[int] = set()

        # (group, place in group 1, value, arrival): group 1 holds the parked replies
        # that must start back now, then those that take free pages only, then the late
        # requests and the other runners by urgency
        def key(r: Request) -> tuple[int, int, float, float]:
            urgency = self.urgency(s, r, now)
            if r.status == RUNNING:
                if is_protected(r, residency_window(r, k, self.params.residency_share)):
                    return (0, 0, 0.0, r.arrival_time)  # protected, oldest first
                return (1, 2, -urgency, r.arrival_time)
            if replies != "lag" and r.token_times and r.status == ROTARY:
                lag = virtual_lag(r, now, self.params)
                if reply_due_on_time(s, r, now, step_s):
                    return (1, 0, -urgency, r.arrival_time)  # must start back now
                if lag > 0:  # parked past ``beta_b`` of a gap: displaces by urgency
                    return (1, 2, -urgency, r.arrival_time)
                free_only.add(id(r))  # free pages only, ahead of late first tokens
                return (1, 1, -urgency, r.arrival_time)
            missed = missed_ttft(r, now)
            if urgency > 0 and not missed:
                return (1, 2, -urgency, r.arrival_time)  # late: may displace runners
            if missed and hopeless_last:
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
    # ``beta * ttft_ms / 1000``, not ``beta * ttft_s``: the same float as always
    return (not r.token_times and now - r.arrival_time > beta * r.slo.ttft_ms / 1000
            and not missed_ttft(r, now))
