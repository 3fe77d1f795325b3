"""TBT misses told apart: those whose gap overlaps a span the request spent off the
device (rotated out, parked, coming back) and those of slow steps."""

from __future__ import annotations

import pytest

from superinfer_jax.request import (
    ROTARY,
    ROTATING_IN,
    ROTATING_OUT,
    RUNNING,
    WAITING,
    RequestStatus,
)
from superinfer_jax.sim.metrics import Timeline, parked_spans, summarize, tbt_misses


def test_parked_spans_from_a_status_log():
    log = [(0.0, WAITING), (0.1, RUNNING), (1.0, ROTATING_OUT), (1.05, ROTARY),
           (1.6, ROTATING_IN), (1.7, RUNNING), (2.0, ROTARY),  # parked straight away
           (2.4, WAITING),  # the host copy was lost: back to the queue
           (2.5, RUNNING), (3.0, ROTATING_OUT), (3.2, RequestStatus.FINISHED_ABORTED)]
    assert parked_spans(log) == [(1.0, 1.7), (2.0, 2.4), (3.0, 3.2)]
    assert parked_spans([(0.0, WAITING), (0.1, RUNNING)]) == []
    assert parked_spans([(0.0, RUNNING), (0.5, ROTATING_OUT)]) == [(0.5, 0.5)]


def test_missed_gaps_a_rotation_overlaps_are_counted_apart():
    slo = {"ttft_slo_s": 1.0, "tbt_slo_s": 0.1}
    rotated = Timeline(0.0, [0.2, 0.28, 0.9, 0.98, 1.3], 8, **slo,
                       # rotated out while the 0.28 s token was in flight: the span starts
                       # before the gap it costs, and still counts for it
                       parked=[(0.27, 0.85)])
    fine = Timeline(0.0, [0.2, 0.28, 0.35], 8, **slo)
    failed = Timeline(0.0, [0.2, 0.9], 8, ok=False, **slo)  # not counted, as summarize
    # missed: 0.28 -> 0.9 (parked) and 0.98 -> 1.3 (a slow step)
    assert tbt_misses([rotated, fine, failed]) == (2, 1)
    assert summarize([rotated, fine, failed], 2.0)["tbt_attainment"] == pytest.approx(4 / 6)
    assert rotated.rotated(0.28, 0.9) and not rotated.rotated(0.9, 0.98)
    assert not rotated.rotated(0.85, 0.9)  # touching the span's end is not overlapping
    assert tbt_misses([Timeline(0.0, [0.1, 0.5], 2)]) == (0, 0)  # no SLO: nothing missed
