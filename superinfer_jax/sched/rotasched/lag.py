"""Virtual lag time (VLT): how far each request is behind its own SLO, in seconds.

    waiting  w * ReLU(t - t_arrival    - beta_F * SLO_TTFT)
    rotary   w * alpha * ReLU(t - t_last_token - beta_B * SLO_TBT)
    running  -(t - t_running_since)

``w`` is the priority-class weight; the longest runner has the lowest lag.
"""

from __future__ import annotations

from superinfer_jax.config import RotaSchedConfig
from superinfer_jax.request import ROTARY, ROTATING_OUT, RUNNING, Request


def virtual_lag(req: Request, now: float, p: RotaSchedConfig) -> float:
    weight = p.priority_weights[req.slo.priority_class]
    if req.status == RUNNING:
        since = req.running_since if req.running_since is not None else now
        return -(now - since)
    if req.status in (ROTARY, ROTATING_OUT) and req.token_times:
        overdue = now - req.token_times[-1] - p.beta_b * req.slo.tbt_ms / 1000
        return weight * p.alpha * max(0.0, overdue)
    overdue = now - req.arrival_time - p.beta_f * req.slo.ttft_ms / 1000
    return weight * max(0.0, overdue)


def order_by_lag(reqs: list[Request], now: float, p: RotaSchedConfig) -> list[Request]:
    """Largest lag first; ties broken by arrival (FCFS), so no contention means FCFS."""
    return sorted(reqs, key=lambda r: (-virtual_lag(r, now, p), r.arrival_time))
