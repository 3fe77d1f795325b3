"""The policy interface: ``Scheduler`` runs the stages, a policy answers four questions:

- ``contended(s)``: does this step need decisions? When not, the step is FCFS.
- ``rank(s, now)``: when contended, every request that could run, most urgent first (a
  list or any iterable, read once from the head: a lazy ranking need not order a long
  queue's tail). The scheduler keeps the head that fits and evicts runners from the tail.
- ``evict_to(s, req)``: where an evicted runner goes, ``HOST`` or ``RECOMPUTE``.
- ``token_budget(s, budget, now, keep)``: when contended, the step's ``StepBudget`` after
  the victims left; ``keep`` holds the ids the selection kept.

Hooks read the scheduler ``s`` and must not change it. A policy is built as
``cls(config)``; the base class is FCFS. ``uses_latency``: the policy reads ``s.latency``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, ClassVar

from superinfer_jax.config import EngineConfig
from superinfer_jax.mypyc_build import mypyc_attr
from superinfer_jax.request import Request
from superinfer_jax.sched.step_plan import HOST, RECOMPUTE, StepBudget

if TYPE_CHECKING:
    from superinfer_jax.sched.scheduler import Scheduler

__all__ = ["HOST", "POLICY_METHODS", "RECOMPUTE", "Policy"]

POLICY_METHODS = ("contended", "rank", "evict_to", "token_budget")


# open to interpreted subclasses (plug-ins, tests) when compiled with mypyc
@mypyc_attr(allow_interpreted_subclasses=True)
class Policy:
    """FCFS: never contended, evicted requests are recomputed."""

    uses_latency: ClassVar[bool] = False

    def __init__(self, config: EngineConfig):
        self.config = config

    def contended(self, s: Scheduler) -> bool:
        return False

    def rank(self, s: Scheduler, now: float) -> Iterable[Request]:
        """FCFS order (a policy that is contended and does not rank)."""
        return sorted(s.candidates(), key=lambda r: r.arrival_time)

    def evict_to(self, s: Scheduler, req: Request) -> str:
        return RECOMPUTE

    def seat_limit(self, s: Scheduler) -> int:
        """Requests that may hold a batch row this step (running or rotating in)."""
        return self.config.engine.max_num_seqs

    def parked_page_limit(self, s: Scheduler) -> int | None:
        """Pages parked replies may hold before no more decoding runners rotate out."""
        return None

    def token_budget(self, s: Scheduler, budget: StepBudget, now: float,
                     keep: set[str]) -> StepBudget:
        return budget

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

