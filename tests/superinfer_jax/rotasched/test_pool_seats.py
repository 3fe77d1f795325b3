"""``rotasched.pool_seat_fraction``: the seats come from the device pool's seats at the
runners' mean context and expected growth (host code only, scripted with
``sched_kit.Driver``)."""

from __future__ import annotations

import dataclasses

import pytest

from superinfer_jax.sched.latency import LatencyModel
from tests.superinfer_jax.sched_kit import PAGE, SCRIPTED_ROTASCHED, Driver, make, req

# a decode call of n seats costs 10 + 20 n ms; no prefill cost; TBT SLO 100 ms (``req``)
TWO_SEATS = LatencyModel(prefill=[0.0, 0.0, 0.0], decode=[0.010, 0.020, 0.0])
PROMPT = 2 * PAGE  # two pages a seat before any output


def driver(pool_share: float | None, step_share: float | None = None) -> Driver:
    params = dataclasses.replace(SCRIPTED_ROTASCHED, pool_seat_fraction=pool_share,
                                 step_slo_fraction=step_share)
    sched, kv = make("rotasched", device_pages=64, host_pages=64, rotasched=params)
    if step_share is not None:
        sched.set_latency_model(TWO_SEATS)
    d = Driver(sched, kv)
    for rid in "abcd":
        d.add(req(rid, PROMPT, arrival=0.0, max_tokens=2))
    return d


def test_seats_are_a_share_of_the_pool_without_a_latency_model() -> None:
    """63 usable pages hold 31 seats of two pages: 0.075 of them is 2 seats, so two of
    four requests are admitted (unset: all four) and nobody is evicted for the rule; once
    the two finish, the other two take the seats."""
    unset = driver(None)
    assert [rid for rid, _ in unset.step(0.0).prefill] == list("abcd")

    d = driver(0.075)
    assert int(0.075 * d.kv.allocator.num_usable / 2) == 2
    assert [rid for rid, _ in d.step(0.0).prefill] == ["a", "b"]
    plan = d.step(0.1)
    assert plan.decode == ["a", "b"] and not plan.rotate_out and not plan.preempted
    assert [r.req_id for r in d.sched.waiting] == ["c", "d"]
    assert not d.sched.running  # both reached max_tokens
    assert [rid for rid, _ in d.step(0.2).prefill] == ["c", "d"]


def test_expected_growth_counts() -> None:
    """A runner's output so far counts twice (made, and as much again expected): after a
    ends with its first token, b at 9 tokens counts (9 + 1) / 4 pages, and 0.075 of the
    pool holds 1 seat, so c is not admitted (at 9 / 4 pages it would hold 2)."""
    d = driver(0.075)
    d.all["a"].sampling = dataclasses.replace(d.all["a"].sampling, max_tokens=1)
    d.step(0.0)  # a and b prefill; a ends with its first token
    assert [r.req_id for r in d.sched.running] == ["b"]
    usable = d.kv.allocator.num_usable
    assert int(0.075 * usable / ((PROMPT + 2) / PAGE)) == 1
    assert int(0.075 * usable / ((PROMPT + 1) / PAGE)) == 2
    plan = d.step(0.1)
    assert plan.decode == ["b"] and not plan.prefill


@pytest.mark.parametrize(("pool_share", "seats"), [(0.075, 2), (1.0, 2), (0.04, 1)])
def test_the_tighter_rule_binds(pool_share: float, seats: int) -> None:
    """With ``step_slo_fraction`` 0.5 (two seats under ``TWO_SEATS``) the pool share binds
    only where it allows fewer seats."""
    d = driver(pool_share, step_share=0.5)
    assert [rid for rid, _ in d.step(0.0).prefill] == list("abcd")[:seats]

