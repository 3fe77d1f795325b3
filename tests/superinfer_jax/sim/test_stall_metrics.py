"""The stall distribution: each request's longest gap, in ms and in its own TBT SLOs."""

from __future__ import annotations

import math

import numpy as np

from superinfer_jax.sim.metrics import Timeline, summarize


def _timeline(times: list[float], tbt_slo_s: float | None) -> Timeline:
    return Timeline(arrival=0.0, prompt_len=4, token_times=times, ok=True,
                    ttft_slo_s=1.0, tbt_slo_s=tbt_slo_s)


def test_the_longest_gap_of_each_request_is_its_stall():
    timelines = [
        _timeline([0.1, 0.2, 0.7, 0.8], 0.1),  # longest gap 0.5 s: 5 SLOs
        _timeline([0.1, 0.3, 0.5], 0.2),  # 0.2 s: 1 SLO
        _timeline([0.1], 0.1),  # one token: no gap, no stall
    ]
    s = summarize(timelines, duration_s=1.0)
    assert math.isclose(s["max_stall_ms"], 500.0)
    assert math.isclose(s["median_stall_ms"], 350.0)
    assert math.isclose(s["p99_stall_ms"], float(np.percentile([500.0, 200.0], 99)))
    assert math.isclose(s["p99_stall_tbt_slos"], float(np.percentile([5.0, 1.0], 99)))


def test_no_stall_without_a_second_token():
    s = summarize([_timeline([0.1], 0.1)], duration_s=1.0)
    assert math.isnan(s["max_stall_ms"]) and math.isnan(s["p99_stall_tbt_slos"])
