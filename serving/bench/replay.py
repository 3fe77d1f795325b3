"""Replay a timed workload through an in-process engine, in real time.

Requests join at their arrival times (the engine's clock is ``time.perf_counter``); the
loop steps while there is work and sleeps until the next arrival when idle. Returns one
``Timeline`` per request, in workload order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from superinfer_jax.sim.metrics import Timeline, parked_spans
from superinfer_jax.sim.workloads import TraceRequest


@dataclass(frozen=True)
class TimedRequest:
    arrival_s: float  # offset from the start of the run
    prompt_token_ids: list[int]
    max_tokens: int
    ttft_ms: float
    tbt_ms: float
    priority_class: str = "standard"
    cache_salt: str | None = None  # prefix-cache isolation (a fresh one: a cold cache)


def build_requests(trace: list[TraceRequest], arrivals: np.ndarray, vocab_size: int,
                   ttft_ms: float, tbt_ms: float, seed: int) -> list[TimedRequest]:
    rng = np.random.default_rng(seed)
    return [TimedRequest(float(a), rng.integers(10, vocab_size - 10, r.prompt_len).tolist(),
                         r.output_len, ttft_ms, tbt_ms)
            for r, a in zip(trace, arrivals, strict=False)]


def replay(engine, requests: list[TimedRequest], progress=None) -> tuple[list[Timeline], float]:
    from superinfer_jax import SLO, SamplingParams

    start = time.perf_counter()
    ids: list[str] = []
    i = 0
    while i < len(requests) or engine.has_unfinished_requests():
        now = time.perf_counter()
        while i < len(requests) and start + requests[i].arrival_s <= now:
            r = requests[i]
            ids.append(engine.add_request(
                r.prompt_token_ids, SamplingParams(max_tokens=r.max_tokens, ignore_eos=True),
                slo=SLO(r.ttft_ms, r.tbt_ms, r.priority_class),
                arrival_time=start + r.arrival_s, cache_salt=r.cache_salt))
            i += 1
        if engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and progress is not None:
                    progress.update(1)
        elif i < len(requests):
            time.sleep(max(0.0, start + requests[i].arrival_s - time.perf_counter()))
    duration = time.perf_counter() - start
    timelines = []
    for req_id, r in zip(ids, requests, strict=True):
        req = engine.release(req_id)
        timelines.append(Timeline(
            arrival=req.arrival_time, token_times=list(req.token_times),
            prompt_len=len(r.prompt_token_ids), ttft_slo_s=r.ttft_ms / 1000,
            tbt_slo_s=r.tbt_ms / 1000, num_rotations=req.num_rotations,
            num_recomputed_tokens=req.num_recomputed_tokens,
            ok=req.status.finish_reason != "abort", parked=parked_spans(req.transitions)))
    return timelines, duration
