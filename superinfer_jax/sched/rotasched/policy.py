"""The policy interface: the decisions a scheduling policy makes, and nothing else.

``superinfer_jax.sched.scheduler.Scheduler`` runs the same stages every step (forced rotations,
ranking, selection, victims, the token budget, rows, rotate-ins, admissions, shadows);
a policy answers four questions for it:

- ``contended(s)``: does this step need decisions at all? When not, the step is FCFS:
  running requests in admission order, parked ones back oldest first, then waiting ones
  with the head blocking, and a request that needs a page evicts the most recent runner.
- ``rank(s, now)``: when contended, every request that could run, most urgent first. The
  scheduler keeps or brings onto the device the head of this list, as far as pages,
  seats and the transfer budget go, and evicts the runners outside it from the tail.
  A list, or any iterable: the scheduler reads it once from the head and stops once it
  has seen every runner and nothing more fits, so a lazy ranking (a generator) need not
  order a long queue's tail (``rotasched.ranking``).
- ``evict_to(s, req)``: where an evicted runner goes, ``HOST`` (rotated out, its KV kept)
  or ``RECOMPUTE`` (its KV dropped, its tokens computed again later).
- ``token_budget(s, budget, now, keep)``: when contended, the step's ``StepBudget``
  (tokens and padded prefill slots) after the victims left; ``keep`` holds the ids the
  selection kept.

Every hook gets the scheduler ``s`` to read (``s.waiting``, ``s.running``, ``s.rotary``,
``s.candidates()``, ``s.device_pages_in_use()``, ``s.kv``, ``s.config``, ``s.latency``,
``s.page_bytes``) and must not change it. A policy is built as ``cls(config)``. The base
class is FCFS; subclass it and override what differs. ``uses_latency``: the policy reads
``s.latency`` (the engine then profiles one at warm-up, the simulator fits one).

Register a policy by name with ``register_policy`` (``superinfer_jax.sched.rotasched.registry``),
or name it by path, ``package.module:Class``, wherever a policy is named.
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


# Compiled with mypyc (``superinfer_jax.mypyc_build``), a class is closed to interpreted
# subclasses unless it says otherwise; policies are meant to be subclassed (plug-ins,
# tests), so every built-in one allows it.
@mypyc_attr(allow_interpreted_subclasses=True)
class Policy:
    """FCFS decisions: never contended, evicted requests are recomputed."""

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

    def parked_page_limit(self, s: Scheduler) -> int | None:
        """Pages the parked replies may hold before the selection stops rotating decoding
        runners out (``Scheduler._evict_unselected``); None: no limit."""
        return None

    def token_budget(self, s: Scheduler, budget: StepBudget, now: float,
                     keep: set[str]) -> StepBudget:
        return budget

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

