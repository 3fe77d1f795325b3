"""Speculation length per decode row: a fixed ``k``, or one chosen from TBT slack and load.

Acceptance model: each proposed token is accepted with probability ``a``, independently,
until the first rejection. Verifying ``k`` proposals emits the accepted ones plus one
token of the target (the correction at the first rejection, or the bonus token after
``k`` acceptances), so a row's expected tokens are

    E(k) = sum_{i=0..k} a^i = (1 - a^(k+1)) / (1 - a)        (k + 1 when a = 1)

and raising ``k`` by one adds ``a^(k+1)`` expected tokens.

Estimate of ``a`` (``AcceptanceEstimator``): a Beta(alpha, beta) posterior per request. A
verification that proposed ``k`` and accepted ``m`` observed ``m`` acceptances and, when
``m < k``, one rejection (the proposals after a rejection are never tested), so
``alpha += m`` and ``beta += (m < k)``; the estimate is the posterior mean.

Cost: ``step_s(rows, tokens)`` is the seconds of the decode call with ``rows`` rows
verifying ``tokens`` tokens in all (each row's own last token plus its proposals), e.g. a
``LatencyModel`` or a cost model evaluated at the step's contexts; ``other_s`` is the rest
of the step (host time, the prefill call), which delays every token of the step too.

Choice in ``slo`` mode (``SpeculationPolicy.choose``): every row starts at ``k = 0``, and
the proposal with the largest expected gain ``a_i^(k_i+1)`` over all rows is added, one
at a time, while

1. it raises the step's expected tokens per second: its gain over the seconds it adds,
   ``step_s(R, T+1) - step_s(R, T)``, exceeds the step's average ``sum E_i / (other_s +
   step_s(R, T))``. On a compute-bound step a verified token costs what a row's token
   costs, so a gain ``a^(k+1) < 1`` never pays: every row keeps ``k = 0``, however far
   ahead of its deadline. On a memory-bound step (small batch) verification is nearly
   free and ``k`` grows towards the argmax of ``E(k) / (other_s + step_s(1, 1 + k))``.
   Adding proposals in decreasing gain with this stopping rule reaches that argmax
   exactly when ``step_s`` is convex in tokens (a roofline: the larger of a memory time
   and a compute time, each linear);
2. the call still ends within the TBT slack (the seconds from the call's start to the
   row's next-token deadline) of every row whose deadline the call without speculation
   meets: speculation never makes a row miss that ``k = 0`` would not. Requests outside
   the call whose next token it delays (a prompt whose first token came from this
   step's prefill call) count too, with the next step's decode call taken off their
   slack;
3. ``k_i`` stays within ``num_tokens`` and the row's own limit (tokens left, context).

``fixed`` mode gives every row ``min(num_tokens, limit)``.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

MODES = ("fixed", "slo")
MAX_SPECULATIVE_TOKENS = 16

StepSeconds = Callable[[int, int], float]  # (rows, verified tokens) -> seconds


def expected_tokens(a: float, k: int) -> float:
    """Expected tokens one verification of ``k`` proposals emits at acceptance rate ``a``."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass
class AcceptanceEstimator:
    """Beta posterior of one request's per-token acceptance rate (prior Beta(alpha,
    beta); the uniform prior by default)."""

    alpha: float = 1.0
    beta: float = 1.0

    def __post_init__(self) -> None:
        if not (self.alpha > 0 and self.beta > 0):
            raise ValueError(f"alpha and beta must be > 0, got {self.alpha}, {self.beta}")

    def update(self, proposed: int, accepted: int) -> None:
        """One verification: ``accepted`` of ``proposed`` tokens, a rejection after them
        unless all were accepted."""
        if not 0 <= accepted <= proposed:
            raise ValueError(f"need 0 <= accepted <= proposed, got {accepted}, {proposed}")
        self.alpha += accepted
        self.beta += accepted < proposed

    @property
    def mean(self) -> float:
        return self.alpha / (self.alpha + self.beta)


@dataclass(frozen=True)
class SpeculationPolicy:
    """``mode``: ``fixed`` (every row proposes ``num_tokens``) or ``slo`` (per row, at
    most ``num_tokens``, chosen as the module docstring says)."""

    mode: str = "fixed"
    num_tokens: int = 3

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"speculative mode must be one of {MODES}, got {self.mode!r}")
        if not 1 <= self.num_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative num_tokens must be in [1, "
                             f"{MAX_SPECULATIVE_TOKENS}], got {self.num_tokens}")

    def choose(self, acceptance: Sequence[float], slack_s: Sequence[float],
               limits: Sequence[int], step_s: StepSeconds, other_s: float = 0.0,
               delayed_slack_s: Sequence[float] = ()) -> list[int]:
        """``k`` per row. ``acceptance``: each row's estimated rate; ``slack_s``: seconds
        from the decode call's start to its next-token deadline (``inf``: none);
        ``limits``: the most tokens each row may propose; ``delayed_slack_s``: the same
        for requests outside the call whose next token the call delays (a prompt that
        got its first token from this step's prefill call)."""
        n = len(acceptance)
        if len(slack_s) != n or len(limits) != n:
            raise ValueError("acceptance, slack_s and limits must have one entry per row")
        cap = self.num_tokens
        ks = [max(0, min(cap, lim)) for lim in limits]
        if self.mode == "fixed" or n == 0:
            return ks
        return _choose_slo(acceptance, [*slack_s, *delayed_slack_s], ks, step_s, other_s)


def _choose_slo(acceptance: Sequence[float], slack_s: Sequence[float], caps: list[int],
                step_s: StepSeconds, other_s: float) -> list[int]:
    """Rule 1-3 of the module docstring: proposals in decreasing expected gain."""
    n = len(acceptance)  # ``slack_s`` may have more entries: requests the call delays
    ks = [0] * n
    tokens = n
    seconds = step_s(n, tokens)
    bound = min((s for s in slack_s if s >= seconds), default=float("inf"))
    expected = float(n)
    # a row's next gain is a_i^(k_i+1), falling as k_i grows, so popping the largest next
    # gain over the rows takes every proposal in decreasing gain (ties: the first row)
    heap = [(-a, i) for i, (a, c) in enumerate(zip(acceptance, caps, strict=True))
            if c > 0 and a > 0.0]
    heapq.heapify(heap)
    while heap:
        neg_gain, i = heap[0]
        gain = -neg_gain
        more = step_s(n, tokens + 1)
        if more > bound or gain * (other_s + seconds) <= expected * (more - seconds):
            break
        ks[i] += 1
        tokens += 1
        seconds = more
        expected += gain
        if ks[i] < caps[i]:
            heapq.heapreplace(heap, (-gain * acceptance[i], i))
        else:
            heapq.heappop(heap)
    return ks
