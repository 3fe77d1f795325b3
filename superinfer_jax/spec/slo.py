"""``speculative.mode: slo`` in the engine: each step, the speculation length of every
decode row from ``sched.speculation.SpeculationPolicy.choose``, fed with the engine's
state.

- **Acceptance**: a Beta(1, 1) posterior per request (``AcceptanceEstimator``), updated
  as its verified rows land (``observe``): ``m`` accepted of ``k`` proposed is ``m``
  acceptances and, when ``m < k``, one rejection. A new request starts at 0.5. Each
  step a row's guess is passed over, its evidence beyond the prior shrinks by ``AGE``:
  a row at ``k = 0`` verifies nothing, so without it an estimate that fell early (a
  few rejections at the start of a reply) would never be revised.
- **Cost**: ``step_s(rows, tokens)`` is the latency model's decode call over the rows
  (``d0 + d1 * rows + d2 * context``) plus each proposal priced as a token of a
  multi-token row, which is what a verify row is: the prefill fit's per-token cost
  ``p1`` plus its attention ``p2`` over the longest row's context plus ``num_tokens``.
  (The decode fit's per-row cost cannot price a token at batch 1: with one decode
  bucket it is not separable from the fixed part.) ``other_s`` is the step's prefill
  call (the latency model's prefill cost of the plan's prefill rows).
- **Slack**: a row's next-token deadline (its last token's time plus its TBT SLO) less
  now; a prompt that completes in this step's prefill call waits for this step and the
  next one, so its slack is its TBT SLO less the next step's decode call.
- **Rows**: every decode row of the plan counts in the call (the rows that may not
  speculate with ``k = 0``: they bound its deadline and its cost); each speculating row
  may propose at most what its proposer guessed.
- **As the engine runs it**: the policy prices verified tokens; the engine runs the
  speculating rows in a verify call padded to ``1 + num_tokens`` columns and the others
  in a decode call of their own. The choice stands only if, priced that way, it still
  yields more expected tokens per second than no speculation and keeps every deadline
  the plain call keeps; else no row speculates this step.

Without a latency model (warm-up off and no profile saved yet) a step cannot be priced,
so no row speculates (``k = 0``: the row decodes as usual) until one is set; the engine
loads or measures one at warm-up in this mode.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np

from superinfer_jax.config import bucket
from superinfer_jax.request import Request
from superinfer_jax.sched.latency import LatencyModel
from superinfer_jax.sched.speculation import (
    AcceptanceEstimator,
    SpeculationPolicy,
    StepSeconds,
    expected_tokens,
)
from superinfer_jax.sched.step_plan import StepPlan

log = logging.getLogger(__name__)

INF = float("inf")
# Per guess passed over (k = 0 while the proposer guessed), the share of a request's
# acceptance evidence kept: acceptance drifts along a reply (chat that turns to
# quoting), so a request whose estimate fell is tried again after about
# log(1/3) / log(AGE) = 10 such steps rather than never.
AGE = 0.9


def latency_step_seconds(latency: LatencyModel, contexts: Sequence[int],
                         cap: int) -> StepSeconds:
    """``step_s(rows, tokens)`` of a decode call over rows of these contexts (tokens
    before the call) with ``tokens - rows`` proposals of at most ``cap`` per row: the rows
    as the decode fit prices them, each proposal as the prefill fit prices a token of a
    multi-token row (``p1``, measured on whole chunks: never under a token's cost in a
    short row) attending to the longest context plus ``cap``."""
    d0, d1, d2 = latency.decode
    _, p1, p2 = latency.prefill
    total, longest = sum(contexts), max(contexts, default=0)
    per_proposal = p1 + p2 * (longest + 1 + cap)

    def step_s(num_rows: int, tokens: int) -> float:
        return d0 + d1 * num_rows + d2 * (total + num_rows) \
            + per_proposal * (tokens - num_rows)

    return step_s


def prefill_seconds(latency: LatencyModel, rows: Sequence[tuple[int, int]]) -> float:
    """The prefill call over ``(new tokens, context before them)`` rows: one fixed part,
    each row's tokens and attention."""
    if not rows:
        return 0.0
    p0 = latency.prefill[0]
    return p0 + sum(latency.prefill_s(n, ctx) - p0 for n, ctx in rows)


class SloLength:
    """Chooses each decode row's speculation length in ``slo`` mode (module docstring)."""

    def __init__(self, num_tokens: int, decode_buckets: tuple[int, ...]):
        self.policy = SpeculationPolicy("slo", num_tokens)
        self.buckets = decode_buckets  # the verify and decode calls' padded row counts
        self.estimates: dict[str, AcceptanceEstimator] = {}
        self._warned = False

    def observe(self, req_id: str, proposed: int, accepted: int) -> None:
        """One verification of ``req_id``'s row landed."""
        if proposed:
            self.estimates.setdefault(req_id, AcceptanceEstimator()).update(proposed,
                                                                            accepted)

    def acceptance(self, req_id: str) -> float:
        est = self.estimates.get(req_id)
        return est.mean if est is not None else AcceptanceEstimator().mean

    def choose(self, plan: StepPlan, requests: dict[str, Request],
               candidates: Sequence[Request], proposals: Sequence[np.ndarray],
               latency: LatencyModel | None, now: float | None = None) -> list[int]:
        """How many of each candidate's proposed tokens to verify this step."""
        self._forget(requests)
        if latency is None:
            if not self._warned:
                log.info("speculative.mode slo: no latency profile yet, so no step can be "
                         "priced; decoding without speculation until one is set")
                self._warned = True
            return [0] * len(candidates)
        now = time.perf_counter() if now is None else now
        index = {req.req_id: i for i, req in enumerate(candidates)}
        rows = [requests[r] for r in plan.decode]  # candidates are among them
        acceptance, limits = [0.0] * len(rows), [0] * len(rows)
        for j, req in enumerate(rows):
            i = index.get(req.req_id)
            if i is not None:
                acceptance[j] = self.acceptance(req.req_id)
                limits[j] = int(proposals[i].shape[0])
        slack = [_slack(req, now) for req in rows]
        step_s = latency_step_seconds(latency, [r.num_computed_tokens for r in rows],
                                      self.policy.num_tokens)
        prefill = [(n, requests[r].num_computed_tokens) for r, n in plan.prefill]
        other_s = prefill_seconds(latency, prefill)
        completing = [requests[r] for r, n in plan.prefill
                      if requests[r].num_computed_tokens + n >= requests[r].num_tokens]
        plain = step_s(len(rows), len(rows)) if completing else 0.0
        delayed = [req.slo.tbt_s - plain for req in completing]
        ks = self.policy.choose(acceptance, slack, limits, step_s, other_s, delayed)
        if any(ks) and not self._pays_as_run(rows, acceptance, ks, latency, other_s,
                                             [*slack, *delayed]):
            ks = [0] * len(rows)
        for req, k, limit in zip(rows, ks, limits, strict=True):
            if limit and not k:
                self._age(req.req_id)
        chosen = {req.req_id: k for req, k in zip(rows, ks, strict=True)}
        return [chosen.get(req.req_id, 0) for req in candidates]

    def _pays_as_run(self, rows: Sequence[Request], acceptance: Sequence[float],
                     ks: Sequence[int], latency: LatencyModel, other_s: float,
                     slack: Sequence[float]) -> bool:
        """Whether ``ks`` as the engine runs them beats no speculation and keeps every
        deadline the plain call keeps: the speculating rows in a verify call padded to
        its row bucket and ``1 + num_tokens`` columns, the others in a decode call of
        their own (a second pass over the weights), which the policy does not price."""
        cap = self.policy.num_tokens

        def call_s(subset: Sequence[Request], cols: int) -> float:
            if not subset:
                return 0.0
            num = bucket(len(subset), self.buckets)
            price = latency_step_seconds(latency, [r.num_computed_tokens for r in subset],
                                         cap)
            return price(num, num * cols)

        plain = call_s(rows, 1)
        run = call_s([r for r, k in zip(rows, ks, strict=True) if not k], 1) \
            + call_s([r for r, k in zip(rows, ks, strict=True) if k], 1 + cap)
        if any(plain <= s < run for s in slack):
            return False
        gained = sum(expected_tokens(a, k) for a, k in zip(acceptance, ks, strict=True))
        return gained * (other_s + plain) > len(rows) * (other_s + run)

    def _age(self, req_id: str) -> None:
        """A guess passed over: the evidence beyond the prior shrinks by ``AGE``."""
        est = self.estimates.get(req_id)
        if est is not None:
            est.alpha = 1.0 + AGE * (est.alpha - 1.0)
            est.beta = 1.0 + AGE * (est.beta - 1.0)

    def _forget(self, requests: dict[str, Request]) -> None:
        """Drop the estimates of requests the engine no longer holds."""
        if len(self.estimates) > 2 * len(requests) + 16:
            self.estimates = {r: e for r, e in self.estimates.items() if r in requests}


def _slack(req: Request, now: float) -> float:
    """Seconds from ``now`` to ``req``'s next-token deadline (``inf``: no token yet)."""
    if not req.token_times:
        return INF
    return req.token_times[-1] + req.slo.tbt_s - now
