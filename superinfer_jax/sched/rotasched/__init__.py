"""Scheduling policies: the interface (``policy``), the built-ins (``policies``: fcfs,
swap, rotasched), names and ``module:Class`` paths (``registry``), virtual lag (``lag``).

The stages that run a policy are ``superinfer_jax.sched.scheduler.Scheduler``; how to write a
policy: ``docs/research.md``."""

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
