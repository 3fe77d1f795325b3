"""Speculative decoding in the simulator: acceptance drawn per request, rows verified in
the decode call.

Each request gets a true per-token acceptance rate when it arrives, drawn with the run's
seeded RNG from ``Beta(2, 2)`` (``beta22``) or uniformly from a list of measured rates
(``measured``): by default the per-request rates of the CPU n-gram runs, committed in
``data/ngram_acceptance.json`` with how they were made (``benchmarks.speculative
--acceptance-data``). Each step, ``SpeculationPolicy`` (``sched.speculation``) chooses ``k``
per decode row from the request's estimated rate (``AcceptanceEstimator``, updated after
every verification), the decode call's cost at this step's contexts and the row's TBT
slack; the call is priced with the ``k`` proposals as extra query tokens (``CallShape``:
``1 + k`` tokens in the row), and the row emits ``1 + m`` tokens at the call's end, ``m``
the accepted proposals: each accepted with the request's rate until the first rejection.
Pages are reserved for ``1 + k`` tokens before the call (``k`` shrinks to what fits) and
kept for the ``1 + m`` the row keeps, as the engine truncates the rejected tail. The
scheduler's token budget still counts one token per decode row.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import TYPE_CHECKING, Any

from superinfer_jax.sched.speculation import (
    AcceptanceEstimator,
    SpeculationPolicy,
    StepSeconds,
)
from superinfer_jax.sim.cost import CallShape, CostModel

if TYPE_CHECKING:
    from superinfer_jax.sim.simulator import SimRequest

ACCEPTANCE_MODELS = ("beta22", "measured")
MEASURED_DATA = "ngram_acceptance.json"  # in this package's data/


def load_measured_rates(path: str | None = None) -> tuple[float, ...]:
    """The ``rates`` list of an acceptance data file (``benchmarks.speculative
    --acceptance-data``); ``path`` None: the committed n-gram runs' file."""
    try:
        if path is None:
            text = resources.files(__package__).joinpath("data", MEASURED_DATA).read_text()
        else:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        rates = json.loads(text)["rates"]
        return tuple(float(a) for a in rates)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"acceptance rates: cannot read a 'rates' list from "
                         f"{path or MEASURED_DATA}: {e}") from e


MEASURED_RATES: tuple[float, ...] = load_measured_rates()


@dataclass(frozen=True)
class SpeculationSpec:
    """What ``--speculative MODE:K --acceptance MODEL`` asks of a run."""

    policy: SpeculationPolicy
    acceptance: str = "beta22"
    measured_rates: tuple[float, ...] = MEASURED_RATES
    seed: int = 0

    def __post_init__(self) -> None:
        if self.acceptance not in ACCEPTANCE_MODELS:
            raise ValueError(f"acceptance must be one of {ACCEPTANCE_MODELS}, "
                             f"got {self.acceptance!r}")
        if not self.measured_rates or any(not 0.0 <= a <= 1.0 for a in self.measured_rates):
            raise ValueError(f"measured acceptance rates must be in [0, 1], got "
                             f"{self.measured_rates}")

    @property
    def label(self) -> str:
        return f"{self.policy.mode}:{self.policy.num_tokens}"

    @staticmethod
    def parse(text: str, acceptance: str = "beta22",
              measured_rates: Sequence[float] = MEASURED_RATES,
              seed: int = 0) -> SpeculationSpec:
        """``fixed:K`` or ``slo:K`` (``K``: the fixed length, or the most ``slo`` picks)."""
        mode, sep, k = text.partition(":")
        try:
            num = int(k)
        except ValueError:
            num = -1
        if not sep or num < 0:
            raise ValueError(f"--speculative {text!r}: expected fixed:K or slo:K with K an "
                             f"integer")
        return SpeculationSpec(SpeculationPolicy(mode, num), acceptance,
                               tuple(measured_rates), seed)


@dataclass
class SpecState:
    """One run's speculation: each request's true rate, estimate and RNG, counters.

    Each request draws from its own RNG, seeded by the run's seed and its id, so a
    request gets the same rate and the same acceptance draws under every policy (the
    runs are paired): which policy ran before it changes nothing."""

    spec: SpeculationSpec
    rngs: dict[str, random.Random] = field(default_factory=dict)
    rate: dict[str, float] = field(default_factory=dict)
    estimate: dict[str, AcceptanceEstimator] = field(default_factory=dict)
    num_drafts: int = 0  # rows that proposed at least one token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.spec.policy.num_tokens

    def add(self, req_id: str) -> None:
        """Draw ``req_id``'s true acceptance rate from its own RNG."""
        rng = self.rngs[req_id] = random.Random(f"{self.spec.seed}:{req_id}")
        if self.spec.acceptance == "beta22":
            a = rng.betavariate(2.0, 2.0)
        else:
            a = rng.choice(self.spec.measured_rates)
        self.rate[req_id] = a
        self.estimate[req_id] = AcceptanceEstimator()

    def accepted(self, req_id: str, k: int) -> int:
        """Proposals of ``k`` accepted: each with the request's rate until a rejection."""
        a, rng, m = self.rate[req_id], self.rngs[req_id], 0
        while m < k and rng.random() < a:
            m += 1
        return m

    def choose(self, rows: list[SimRequest], limits: list[int], now: float, other_s: float,
               cost: CostModel, started: Sequence[SimRequest] = ()) -> list[int]:
        """``k`` per decode row for a call starting at ``now``; ``started``: requests that
        got their first token at ``now`` from the prefill call, whose second token waits
        for this call and the next step's (taken to be at least this call unspeculated)."""
        slack = []
        for q in rows:
            tbt = q.slo.tbt_s
            last = q.token_times[-1] if len(q.token_times) else now
            slack.append(last + tbt - now)
        step_s = call_seconds([q.num_computed_tokens for q in rows],
                              self.spec.policy.num_tokens, cost)
        acceptance = [self.estimate[q.req_id].mean for q in rows]
        plain = step_s(len(rows), len(rows)) if started else 0.0
        delayed = [q.slo.tbt_s - plain for q in started]
        return self.spec.policy.choose(acceptance, slack, limits, step_s, other_s, delayed)

    def record(self, req_id: str, k: int, m: int) -> None:
        self.estimate[req_id].update(k, m)
        if k:
            self.num_drafts += 1
            self.num_draft_tokens += k
            self.num_accepted_tokens += m
            for pos in range(m):
                self.accepted_per_pos[pos] += 1

    def forget(self, req_id: str) -> None:
        self.rate.pop(req_id, None)
        self.rngs.pop(req_id, None)
        self.estimate.pop(req_id, None)

    def summary(self) -> dict[str, Any]:
        drafted = self.num_draft_tokens
        return {
            "spec_policy": self.spec.label,
            "spec_acceptance_model": self.spec.acceptance,
            "spec_num_drafts": self.num_drafts,
            "spec_num_draft_tokens": drafted,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
            "spec_acceptance_rate": self.num_accepted_tokens / drafted if drafted else 0.0,
        }


def call_seconds(contexts: list[int], cap: int, cost: CostModel) -> StepSeconds:
    """``step_s(rows, tokens)`` of a decode call over rows of these contexts (before the
    call) with ``tokens - rows`` proposals of at most ``cap`` per row, each priced as if
    in the longest row: never under ``decode_shape``'s true price, so a deadline the
    policy keeps holds."""
    total, longest = sum(contexts), max(contexts)

    def step_s(num_rows: int, tokens: int) -> float:
        extra = tokens - num_rows
        pairs = total + num_rows + extra * (longest + 1 + cap)
        return cost.decode_call_s(CallShape(num_rows, 1 + min(extra, cap), tokens,
                                            total + tokens, pairs, longest + 1 + cap))

    return step_s


def decode_shape(rows: list[SimRequest], ks: list[int]) -> CallShape:
    """The decode call verifying ``1 + k`` tokens in each row."""
    return CallShape.of_rows([(1 + k, q.num_computed_tokens) for q, k in zip(rows, ks,
                                                                               strict=True)])


def row_limits(rows: list[SimRequest], max_len: int) -> list[int]:
    """The most proposals each row can use: its tokens left after this step's one, and its
    context up to ``max_len``."""
    return [min(q.output_len - q.num_output, max_len - q.num_tokens) - 1 for q in rows]
