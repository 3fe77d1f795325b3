"""Discrete-event simulator: the engine's policies and page bookkeeping on a cost model.

``Simulator`` (``simulator``) plays a workload of ``RequestSpec`` through the same
scheduler and ``TwoTierKVManager`` the engine uses; ``cost`` prices the model calls and
page copies (a roofline of a model preset on a hardware preset, or this machine's
profiled latency model); ``presets`` names paper-scale setups; ``stats`` summarizes.
"""

from superinfer_jax.sim.cost import (
    CalibratedCost,
    CallShape,
    ConstantCost,
    CostModel,
    HostOverhead,
    RooflineCost,
    latency_model_of,
)
from superinfer_jax.sim.request_specs import ConversationSpec, HashIdTokens, RequestSpec
from superinfer_jax.sim.simulator import SimRequest, SimResult, Simulator

__all__ = [
    "CalibratedCost",
    "CallShape",
    "ConstantCost",
    "ConversationSpec",
    "CostModel",
    "HashIdTokens",
    "HostOverhead",
    "RequestSpec",
    "RooflineCost",
    "SimRequest",
    "SimResult",
    "Simulator",
    "latency_model_of",
]
