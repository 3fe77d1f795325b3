"""Scheduling policies: the interface (``policy``), the built-ins (``policies``), names and
paths (``registry``), virtual lag (``lag``). How to write one: ``docs/research.md``."""

from superinfer_jax.sched.rotasched.policies import FCFSPolicy, RotaSchedPolicy, SwapPolicy
from superinfer_jax.sched.rotasched.policy import HOST, RECOMPUTE, Policy
from superinfer_jax.sched.rotasched.registry import (
    make_policy,
    make_scheduler,
    register_policy,
    registered_policies,
    resolve_policy,
)
from superinfer_jax.sched.step_plan import StepBudget, StepPlan

__all__ = ["FCFSPolicy", "HOST", "Policy", "RECOMPUTE", "RotaSchedPolicy", "StepBudget",
           "StepPlan", "SwapPolicy", "make_policy", "make_scheduler", "register_policy",
           "registered_policies", "resolve_policy"]
