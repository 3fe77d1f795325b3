"""``rotasched.step_slo_fraction``: the seats come from the latency model, not only from
``max_num_seqs`` (host code only, scripted with ``sched_kit.Driver``)."""

from __future__ import annotations

import dataclasses

import pytest

from superinfer_jax.sched.latency import LatencyModel
from tests.superinfer_jax.sched_kit import SCRIPTED_ROTASCHED, Driver, make, req

# a decode call of n seats costs 10 + 20 n ms; no prefill cost; TBT SLO 100 ms (``req``)
TWO_SEATS = LatencyModel(prefill=[0.0, 0.0, 0.0], decode=[0.010, 0.020, 0.0])
NO_SEAT = LatencyModel(prefill=[0.0, 0.0, 0.0], decode=[0.010, 0.050, 0.0])


def driver(fraction: float | None, high_water_mark: float) -> Driver:
    params = dataclasses.replace(SCRIPTED_ROTASCHED, step_slo_fraction=fraction,
                                 high_water_mark=high_water_mark)
    sched, kv = make("rotasched", device_pages=64, host_pages=64, rotasched=params)
    sched.set_latency_model(TWO_SEATS)
    d = Driver(sched, kv)
    for rid in "abcd":
        d.add(req(rid, 8, arrival=0.0, max_tokens=3))
    return d


@pytest.mark.parametrize("high_water_mark", [0.5, 0.01], ids=["uncontended", "contended"])
def test_seats_follow_the_modelled_step_and_evict_nobody(high_water_mark: float) -> None:
    """Half of the 100 ms TBT SLO holds a decode call of two seats (10 + 2 x 20 ms): two
    of four requests are admitted, unset all four are. A model under which not even one
    seat fits evicts neither runner (the rule refuses new seats only); once they finish,
    the waiting two take the free seats."""
    unset = driver(None, high_water_mark)
    assert [rid for rid, _ in unset.step(0.0).prefill] == ["a", "b", "c", "d"]

    d = driver(0.5, high_water_mark)
    assert [rid for rid, _ in d.step(0.0).prefill] == ["a", "b"]
    assert d.step(0.1).decode == ["a", "b"]  # two seats: c and d still wait
    assert [r.req_id for r in d.sched.waiting] == ["c", "d"]
    d.sched.set_latency_model(NO_SEAT)
    plan = d.step(0.2)
    assert plan.decode == ["a", "b"] and not plan.rotate_out and not plan.preempted
    assert not d.sched.running  # both reached max_tokens
    d.sched.set_latency_model(TWO_SEATS)
    assert [rid for rid, _ in d.step(0.3).prefill] == ["c", "d"]
