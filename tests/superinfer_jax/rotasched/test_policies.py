"""Policies on scripted scenarios: who runs, who rotates, in what order (host code only).

``sched_kit.Driver`` plays the engine's part: it applies each plan (tokens computed, one
token sampled at the end of a row) and completes rotations at once, as landed copies would.
"""

from __future__ import annotations

import dataclasses

import pytest

from superinfer_jax.config import EngineConfig, RotaSchedConfig
from superinfer_jax.kv.two_tier import TwoTierKVManager
from superinfer_jax.request import SLO, Request, RequestStatus
from superinfer_jax.sched.rotasched.policies import FCFSPolicy, RotaSchedPolicy, SwapPolicy
from superinfer_jax.sched.rotasched.registry import make_scheduler
from superinfer_jax.sched.rotasched_config import rotasched_preset
from superinfer_jax.sched.scheduler import StepBudget, StepPlan
from tests.superinfer_jax.sched_kit import PAGE, Driver, make, req


def attainment(**knobs) -> RotaSchedConfig:
    """The knobs these tests set over preset ``attainment`` (no caps, every seat the pool
    holds): each test isolates one mechanism; the default preset has its own tests."""
    return rotasched_preset("attainment", **knobs)


def plans_of(policy: str, reqs, steps: int, **kw):
    sched, kv = make(policy, host_pages=64, **kw)
    d = Driver(sched, kv)
    out = []
    for t in range(steps):
        for r in reqs:
            if r.arrival_time == t:
                d.add(Request(r.req_id, list(r.prompt_token_ids), r.sampling, slo=r.slo,
                              arrival_time=r.arrival_time))
        p = d.step(float(t))
        out.append((p.prefill, p.decode, p.preempted, p.rotate_out, p.rotate_in))
    return out


def token_budget(sched, now: float, keep: set[str]) -> tuple[int, int]:
    """(tokens, padded prefill slots) the policy grants a contended step."""
    b = sched.policy.token_budget(sched, StepBudget.full(sched.config), now, keep)
    return b.tokens, b.prefill_slots


def test_factory_picks_policy():
    assert type(make("fcfs", host_pages=64)[0].policy) is FCFSPolicy
    assert type(make("swap", host_pages=64)[0].policy) is SwapPolicy
    assert type(make("rotasched", host_pages=64)[0].policy) is RotaSchedPolicy


def test_no_contention_rotasched_is_exactly_fcfs():
    reqs = [req(f"r{i}", 5 + 3 * i, arrival=float(i % 3)) for i in range(6)]
    a = plans_of("fcfs", reqs, 20)
    b = plans_of("rotasched", reqs, 20)
    assert a == b
    assert any(p[0] for p in a) and any(p[1] for p in a)


def test_hog_and_urgent_short_requests():
    """A long request fills the device; short urgent ones arrive. FCFS makes them wait
    behind it; RotaSched parks the hog once their lag exceeds its, and serves them."""
    hog = req("hog", 36, arrival=0.0, max_tokens=12)  # 9 pages of the 12 usable, growing
    shorts = [req(f"s{i}", 8, arrival=1.0, max_tokens=2) for i in range(3)]

    def run(policy):
        sched, kv = make(policy, device_pages=13, host_pages=64)
        d = Driver(sched, kv)
        d.add(Request(hog.req_id, hog.prompt_token_ids, hog.sampling, slo=hog.slo,
                      arrival_time=0.0))
        first_token = {}
        events = []
        for t in range(0, 60):
            now = t * 0.25
            if t == 4:
                for s in shorts:
                    d.add(Request(s.req_id, s.prompt_token_ids, s.sampling, slo=s.slo,
                                  arrival_time=now))
            p = d.step(now)
            events += [("out", r) for r in p.rotate_out] + [("in", r) for r in p.rotate_in]
            for r in d.all.values():
                if r.token_times and r.req_id not in first_token:
                    first_token[r.req_id] = r.token_times[0] - r.arrival_time
        return first_token, events, d

    fcfs_ttft, fcfs_events, _ = run("fcfs")
    rs_ttft, rs_events, d = run("rotasched")
    assert not fcfs_events
    assert ("out", "hog") in rs_events and ("in", "hog") in rs_events
    assert rs_events.index(("out", "hog")) < rs_events.index(("in", "hog"))
    worst = {name: max(ttft.get(s.req_id, float("inf")) for s in shorts)
             for name, ttft in (("fcfs", fcfs_ttft), ("rotasched", rs_ttft))}
    assert worst["rotasched"] < worst["fcfs"]
    assert d.all["hog"].num_rotations >= 1
    assert d.all["hog"].status == RequestStatus.FINISHED_LENGTH  # it came back and finished


def test_priority_class_goes_first_under_contention():
    sched, kv = make("rotasched", device_pages=9, host_pages=64)
    d = Driver(sched, kv)
    # grows to all 8 pages (contended), and stays more than 4 tokens from its end
    d.add(req("filler", 24, arrival=0.0, max_tokens=12))
    for t in range(5):  # past its minimum residency (4 tokens)
        d.step(t * 0.1)
    d.add(req("std", 8, arrival=1.0))
    d.add(req("crit", 8, arrival=1.1, slo=SLO(1000, 100, "critical")))
    ranked = [r.req_id for r in sched.policy.rank(sched, 2.0)]
    assert ranked.index("crit") < ranked.index("std")  # 4x weight beats 0.1 s of arrival
    plan = d.step(2.0)
    admitted = [r for r, _ in plan.prefill]
    assert "crit" in admitted
    assert "filler" in plan.rotate_out


def test_swap_parks_victim_and_brings_it_back_first():
    sched, kv = make("swap", device_pages=7, host_pages=64)
    d = Driver(sched, kv)
    for rid in "abc":
        d.add(req(rid, 8, arrival=0.0, max_tokens=6))
    d.step(0.0)  # all three prefill: 6 pages
    p = d.step(1.0)  # each needs a third page: the most recent is swapped, not recomputed
    assert p.rotate_out == ["c"] and p.preempted == []
    assert d.all["c"].num_computed_tokens == 8  # its KV is kept, not recomputed
    d.add(req("late", 2, arrival=1.5))
    for t in range(2, 12):
        p = d.step(float(t))
        if p.rotate_in:
            assert p.rotate_in == ["c"]
            assert "late" not in [r for r, _ in p.prefill]  # swapped back before new ones
            break
    else:
        pytest.fail("c never came back")
    assert d.all["c"].num_recomputed_tokens == 0


def test_fcfs_recomputes_where_swap_rotates():
    sched, kv = make("fcfs", device_pages=7, host_pages=64)
    d = Driver(sched, kv)
    for rid in "abc":
        d.add(req(rid, 8, arrival=0.0, max_tokens=6))
    d.step(0.0)
    p = d.step(1.0)
    assert p.preempted == ["c"] and p.rotate_out == []
    assert d.all["c"].num_recomputed_tokens == 8


def test_burst_is_served_in_lag_order_and_nothing_leaks():
    sched, kv = make("rotasched", device_pages=17, host_pages=128,
                     rotasched=attainment(high_water_mark=0.5, min_residency_tokens=4))
    d = Driver(sched, kv)
    burst = [req(f"b{i}", 12, arrival=0.0, max_tokens=10) for i in range(10)]
    for r in burst:
        d.add(r)
    for t in range(400):
        d.step(t * 0.05)
        if not sched.num_unfinished:
            break
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in burst)
    assert kv.num_free_pages == kv.allocator.num_usable
    assert kv.num_host_free_pages == kv.num_host_pages
    assert sum(r.num_rotations for r in burst) > 0


def test_only_late_requests_displace_runners():
    """Under contention a waiting request that is not late yet takes only free pages; once
    past beta_F of its TTFT SLO it may push a runner (past its minimum residency) out."""
    sched, kv = make("rotasched", device_pages=9, host_pages=64)
    d = Driver(sched, kv)
    d.add(req("runner", 24, arrival=0.0, max_tokens=12))
    for t in range(5):
        d.step(t * 0.1)
    d.add(req("new", 8, arrival=0.5, slo=SLO(ttft_ms=1000, tbt_ms=100)))
    early = d.step(0.6)  # lag 0 until 0.5 + 0.5 * 1 s
    assert early.rotate_out == [] and early.prefill == []
    late = d.step(1.2)
    assert late.rotate_out == ["runner"] and [r for r, _ in late.prefill] == ["new"]


def test_runner_near_its_end_is_not_rotated_out():
    """A runner within min_residency_tokens (4) of its max_tokens frees its pages by
    itself within a few steps: a late request waits for them instead of rotating it out
    (which would cost the runner a TBT miss for a few steps' worth of pages)."""
    for max_tokens, displaces in ((9, False), (12, True)):  # 3 or 6 tokens left at 1.2 s
        sched, kv = make("rotasched", device_pages=9, host_pages=64)
        d = Driver(sched, kv)
        d.add(req("runner", 24, arrival=0.0, max_tokens=max_tokens))
        for t in range(6):
            d.step(t * 0.1)
        d.add(req("new", 8, arrival=0.5, slo=SLO(ttft_ms=1000, tbt_ms=100)))
        plan = d.step(1.2)  # "new" is late (past 0.5 + 0.5 * 1 s); the pool is full
        assert (plan.rotate_out == ["runner"]) is displaces
        assert ("new" in [r for r, _ in plan.prefill]) is displaces


def test_a_short_reply_may_rotate_between_its_protected_windows():
    """Windows of ``min_residency_tokens`` (16) at both ends would protect a 24-token reply
    from its first token to its last, so a late request could never displace it; capped
    at a quarter of its max_tokens (6 tokens each), it may rotate out once it has run 6
    tokens and while more than 6 are left."""
    for share, displaces in ((1.0, False), (0.25, True)):
        sched, kv = make("rotasched", device_pages=9, host_pages=64, rotasched=attainment(
            min_residency_tokens=16, residency_share=share))
        d = Driver(sched, kv)
        d.add(req("runner", 24, arrival=0.0, max_tokens=24))
        for t in range(6):  # 6 tokens produced, 18 left
            d.step(t * 0.1)
        d.add(req("new", 8, arrival=0.5, slo=SLO(ttft_ms=1000, tbt_ms=100)))
        plan = d.step(1.2)  # "new" is late (past 0.5 + 0.5 * 1 s); the pool is full
        assert (plan.rotate_out == ["runner"]) is displaces
        assert ("new" in [r for r, _ in plan.prefill]) is displaces


def test_parked_replies_are_capped_at_a_share_of_the_pool():
    """Two decoding runners hold 15 of 16 pages, and two late requests of 7 pages each
    make the selection drop both. With ``parked_share`` 1 (no limit) both rotate out; at
    0.25 (4 pages) the first goes (one parked reply is always allowed) and the second,
    which would park 15 pages in all, stays on the device and keeps decoding."""
    for share, out in ((1.0, ["a", "b"]), (0.25, ["a"])):
        sched, kv = make("rotasched", device_pages=17, host_pages=64, rotasched=attainment(
            min_residency_tokens=4, residency_share=1.0, parked_share=share),
            enable_prefix_caching=False)  # the same prompt: no shared pages
        d = Driver(sched, kv)
        d.add(req("a", 24, arrival=0.0, max_tokens=50))
        d.add(req("b", 24, arrival=0.0, max_tokens=50))
        for t in range(6):  # past their 4-token residency: 8 and 7 pages
            d.step(t * 0.1)
        assert [len(kv.page_table(r)) for r in "ab"] == [8, 7]
        for rid in ("new", "new2"):
            d.add(req(rid, 28, arrival=0.5, slo=SLO(ttft_ms=1000, tbt_ms=100)))
        plan = d.step(1.2)  # both late (past 0.5 + 0.5 * 1 s)
        assert plan.rotate_out == out
        assert plan.decode == [r for r in "ab" if r not in out]
        assert [r for r, _ in plan.prefill] == ["new"]


def test_request_past_its_ttft_deadline_does_not_displace_a_runner():
    """A waiting request whose TTFT is already missed waits for free pages (FCFS); one
    that is late but can still make its deadline rotates the runner out."""
    slo = SLO(ttft_ms=1000, tbt_ms=100)
    for arrival, displaces in ((-2.0, False), (0.2, True)):  # deadline passed / ahead
        sched, kv = make("rotasched", device_pages=9, host_pages=64)
        d = Driver(sched, kv)
        d.add(req("filler", 24, arrival=0.0, max_tokens=20))  # fills all 8 usable pages
        for t in range(6):  # past its minimum residency (4 tokens)
            d.step(t * 0.1)
        d.add(req("new", 8, arrival=arrival, slo=slo))
        plan = d.step(0.9)  # lag of "new": 0.9 - arrival - 0.5 > 0 in both cases
        assert (plan.rotate_out == ["filler"]) is displaces
        assert ("new" in [r for r, _ in plan.prefill]) is displaces


def test_tbt_budget_yields_to_a_late_first_token():
    """Under contention, while someone waits for memory (here: parked), the step's tokens
    are sized to the decoders' TBT SLO, unless a request still waiting for its first
    token is late: then prefill gets the full budget."""
    from superinfer_jax.sched.latency import LatencyModel

    # a high-water mark of 1%: contended as soon as anything holds a page
    sched, kv = make("rotasched", device_pages=64, host_pages=64,
                     rotasched=attainment(min_residency_tokens=4, high_water_mark=0.01))
    d = Driver(sched, kv)
    d.add(req("dec", 8, arrival=0.0, max_tokens=50))
    d.add(req("parked", 8, arrival=0.0, max_tokens=50))
    d.step(0.0)  # prefill: both have their first token and now decode
    sched.force_rotate_out.add("parked")
    d.step(0.1)  # "parked" waits on the host (its copy lands at once in this driver)
    # a decode step costs 60 of the 100 ms TBT, leaving 30 ms: a 16-column prefill call
    # (10 + 16 ms) fits, a 32-column one (10 + 32 ms) does not
    sched.set_latency_model(LatencyModel(prefill=[0.010, 0.001, 0.0], decode=[0.06, 0.0, 0.0]))
    d.add(req("new", 40, arrival=1.0, slo=SLO(ttft_ms=1000, tbt_ms=100)))
    tbt_sized, full = (1 + 16, 16), (64, 64)
    assert token_budget(sched, 1.2, {"new"}) == tbt_sized  # 0.2 s old: not late (0.5 s)
    assert token_budget(sched, 1.6, {"new"}) == full  # late: max_num_batched_tokens
    assert token_budget(sched, 1.6, set()) == tbt_sized  # late but not selected to run
    assert token_budget(sched, 2.5, {"new"}) == tbt_sized  # past its TTFT: hopeless
    # ``late_order: shortest`` (the default): a late first token whose own prefill cannot
    # end by its deadline (50 ms from 1.99 s, deadline 2 s) is as hopeless; by lag it
    # still takes the full budget
    assert sched.policy.params.late_order == "shortest"
    assert token_budget(sched, 1.99, {"new"}) == tbt_sized
    sched.policy.params = dataclasses.replace(sched.policy.params, late_order="lag")
    assert token_budget(sched, 1.99, {"new"}) == full
    sched.policy.params = dataclasses.replace(sched.policy.params, late_order="shortest")
    plan = d.step(1.2)  # the plan follows the budget: one 16-token chunk
    assert plan.decode == ["dec"] and plan.prefill == [("new", 16)]
    assert plan.rotate_in == ["parked"]
    # 20 ms of room: 20 real tokens would fit, but the call is padded to 16 columns and
    # pays its 10 ms fixed cost (26 ms); the step misses TBT anyway, so take it all
    sched.set_latency_model(LatencyModel(prefill=[0.010, 0.001, 0.0], decode=[0.07, 0.0, 0.0]))
    assert token_budget(sched, 1.3, {"new"}) == full


def test_request_whose_token_in_flight_ends_it_stays_running():
    """Async scheduling: a runner with nothing left to schedule (its last token is in
    flight) keeps its seat and its place in ``running`` until the token lands."""
    sched, kv = make("rotasched", device_pages=64, host_pages=64)
    d = Driver(sched, kv)
    for name in ("a", "b"):
        d.add(req(name, 8, arrival=0.0, max_tokens=50))
    d.step(0.0)
    a = d.all["a"]
    a.num_inflight_tokens, a.final_token_inflight = 1, True
    plan = StepPlan()
    sched._run_rows(plan, StepBudget.full(sched.config), 0.1, contended=True)
    assert [r.req_id for r in sched.running] == ["a", "b"]
    assert plan.decode == ["b"] and sched._num_seated() == 2


def test_no_tbt_budget_while_nobody_waits_for_memory():
    """Above the high-water mark but with room for everyone (nothing parked, every waiting
    request selected), prefill is not held back: fcfs would not hold it either."""
    from superinfer_jax.sched.latency import LatencyModel

    sched, kv = make("rotasched", device_pages=64, host_pages=64,
                     rotasched=attainment(min_residency_tokens=4, high_water_mark=0.01))
    d = Driver(sched, kv)
    d.add(req("dec", 8, arrival=0.0, max_tokens=50))
    d.step(0.0)
    sched.set_latency_model(LatencyModel(prefill=[0.010, 0.001, 0.0], decode=[0.06, 0.0, 0.0]))
    d.add(req("new", 40, arrival=1.0))
    d.add(req("other", 8, arrival=1.0))
    assert token_budget(sched, 1.2, {"new", "other"}) == (64, 64)
    assert token_budget(sched, 1.2, {"new"}) == (1 + 16, 16)  # "other" waits for memory
    plan = d.step(1.2)
    assert plan.prefill[0] == ("new", 32)  # max_prefill_chunk, not the TBT-sized 16


def _one_seat_left(rs: RotaSchedConfig, device_pages: int = 17, latency=None) -> Driver:
    """A "filler" runner on 14 pages after two prefill chunks and a decode (0.0-0.2 s),
    protected under ``min_residency_tokens`` 4: with 17 device pages room for one more
    8-token request, with 15 none. ``latency``: a latency model set from the start."""
    sched, kv = make("rotasched", device_pages=device_pages, host_pages=64, rotasched=rs)
    if latency is not None:
        sched.set_latency_model(latency)
    d = Driver(sched, kv)
    d.add(req("filler", 52, arrival=0.0, max_tokens=20))
    for t in (0.0, 0.1, 0.2):
        d.step(t)
    assert kv.num_free_pages == device_pages - 15
    return d


@pytest.mark.parametrize("hopeless_last", [False, True])
def test_hopeless_requests_go_last_when_asked(hopeless_last):
    """Two waiting requests, room for one: by arrival the one already past its TTFT
    deadline takes it; with ``hopeless_last`` the one that can still make it does."""
    rs = attainment(min_residency_tokens=4, residency_share=1.0,
                         hopeless_last=hopeless_last)
    d = _one_seat_left(rs)
    d.add(req("hopeless", 8, arrival=-2.0))  # TTFT SLO 1 s: missed already
    d.add(req("fresh", 8, arrival=0.85))  # not late yet: neither may displace the filler
    plan = d.step(0.9)
    assert plan.rotate_out == []
    assert [r for r, _ in plan.prefill] == (["fresh"] if hopeless_last else ["hopeless"])


@pytest.mark.parametrize(("arrival", "other", "overdue_cap", "served"), [
    (-2.0, 0.85, None, "other"), (-3.5, 0.85, None, "hopeless"),
    (-1.0, 0.24, 2.5, "other"), (-2.0, 0.24, 2.5, "hopeless"), (-2.0, 0.24, None, "other"),
    (-3.5, 0.24, None, "other")])
def test_the_wait_caps_of_a_hopeless_request(arrival, other, overdue_cap, served):
    """One free seat, a hopeless request (TTFT SLO 1 s) and another that is fresh (0.05 s
    old) or late but can still make it (0.66 s), under ``hopeless_wait_cap`` 3. Against
    the fresh one the hopeless one is deferred at 2.9 s and keeps its arrival place at
    4.4 s, taking the seat. Against the late one that place does not help (it comes after
    every late request); ``overdue_wait_cap`` 2.5 puts it ahead once it has waited past
    2.5 s (2.9 s), not before (1.9 s)."""
    rs = attainment(min_residency_tokens=4, residency_share=1.0, hopeless_wait_cap=3.0,
                         overdue_wait_cap=overdue_cap)
    d = _one_seat_left(rs)
    d.add(req("hopeless", 8, arrival=arrival))
    d.add(req("other", 8, arrival=other))
    plan = d.step(0.9)
    assert plan.rotate_out == []
    assert [r for r, _ in plan.prefill] == [served]


@pytest.mark.parametrize(("arrival", "overdue_cap", "served"), [
    (-1.0, 2.5, "other"), (-2.0, 2.5, "hopeless"), (-2.0, None, "other")])
def test_the_overdue_cap_in_mode_slack(arrival, overdue_cap, served):
    """Mode ``slack`` (the other request's prefill priced well within its deadline) puts
    the hopeless request ahead once it has waited past ``overdue_wait_cap`` 2.5 TTFT SLOs,
    not before, and not without the cap: as mode ``vlt`` does."""
    from superinfer_jax.sched.latency import LatencyModel

    rs = attainment(mode="slack", min_residency_tokens=4, residency_share=1.0,
                         hopeless_wait_cap=3.0, overdue_wait_cap=overdue_cap)
    d = _one_seat_left(rs, latency=LatencyModel(prefill=[0.01, 0.001, 0.0],
                                                decode=[0.01, 0.0, 0.0]))
    d.add(req("hopeless", 8, arrival=arrival))
    d.add(req("other", 8, arrival=0.24))
    assert [r for r, _ in d.step(0.9).prefill] == [served]


@pytest.mark.parametrize("overdue_cap", [2.5, None])
def test_an_overdue_request_displaces_an_unprotected_runner(overdue_cap):
    """No free page, a settled runner (``min_residency_tokens`` 1) and a request 2.9 s
    past its arrival (TTFT SLO 1 s): past ``overdue_wait_cap`` 2.5 it rotates the runner
    out, as a late request would; without the cap it is deferred and nobody moves."""
    rs = attainment(min_residency_tokens=1, residency_share=1.0,
                         overdue_wait_cap=overdue_cap)
    d = _one_seat_left(rs, device_pages=15)
    d.add(req("hopeless", 8, arrival=-2.0))
    assert d.step(0.9).rotate_out == (["filler"] if overdue_cap else [])


def _parked_reply(mode: str | None, step_s: float = 0.01, preset: str = "attainment",
                  **knobs):
    """"runner" and "reply" decode past their 4-token residency, then a late first token
    ("new") displaces "reply" (the runner ranked last) and takes its pages: "reply" is
    parked with its next token due 100 ms after its last, and 3 pages are free, one too
    few for it. A latency model prices a decode step at ``step_s`` and a copy at nothing.
    The knobs start from ``preset`` (``attainment``: no caps, unless the test sets one)."""
    from superinfer_jax.sched.latency import LatencyModel

    # ``lag``: the paper's rule (beta_b 0); ``free_pages``: a reply lags 500 ms past its
    # last token; None: the preset's
    if mode is not None:
        knobs = {"parked_replies": mode, "beta_b": 0.0 if mode == "lag" else 5.0, **knobs}
    rs = rotasched_preset(preset, min_residency_tokens=4, residency_share=1.0, **knobs)
    sched, kv = make("rotasched", device_pages=12, host_pages=64, rotasched=rs,
                     enable_prefix_caching=False)
    d = Driver(sched, kv)
    d.add(req("runner", 8, arrival=0.0, max_tokens=40))
    d.add(req("reply", 8, arrival=0.0, max_tokens=40))
    for t in range(6):
        d.step(t * 0.01)
    d.add(req("new", 12, arrival=-0.6))  # TTFT SLO 1 s: late, not missed
    assert d.step(0.06).prefill == [("new", 12)]
    assert d.step(0.07).rotate_out == ["reply"]
    sched.set_latency_model(LatencyModel(prefill=[0.01, 0.001, 0.0],
                                         decode=[step_s, 0.0, 0.0]))
    reply = d.all["reply"]
    assert reply.status == RequestStatus.ROTARY and kv.num_free_pages == 3
    return sched, kv, d, reply


@pytest.mark.parametrize("mode", ["lag", "free_pages"])
def test_a_parked_reply_displaces_a_runner_only_to_be_on_time(mode):
    """A reply parked while the pool is full: 15 ms before its deadline it rotates the
    unprotected runner out in either mode (with ``free_pages`` because it must start back
    now, a copy and a 10 ms step, to be on time; with ``lag`` because it lags from the
    moment it is parked). Once its next token is late whatever happens, it displaces the
    runner by lag in mode ``lag``; with ``free_pages`` (no stall cap) it waits for free
    pages, as displacing the runner would only make the runner's next token late too,
    until it has been parked ``beta_b`` (5) TBT SLOs past its last token: then it lags,
    and displaces by lag."""
    no_cap = {"reply_stall_cap": None}
    sched, kv, d, reply = _parked_reply(mode, **no_cap)
    last = reply.token_times[-1]  # TBT SLO 100 ms: the next token is due at last + 0.1
    assert sched.schedule(last + 0.085).rotate_out == ["runner"]  # "new" is settling

    sched, kv, d, reply = _parked_reply(mode, **no_cap)
    last = reply.token_times[-1]
    late = sched.schedule(last + 0.3)
    assert late.rotate_out == (["runner"] if mode == "lag" else [])
    assert ("runner" in late.decode) is (mode == "free_pages")
    if mode == "free_pages":
        assert sched.schedule(last + 0.45).rotate_out == []
        assert sched.schedule(last + 0.55).rotate_out == ["runner"]


def test_under_attainment_a_late_parked_reply_waits_for_free_pages_up_to_beta_b():
    """Preset ``attainment`` (``parked_replies: free_pages``, ``beta_b`` 30, no stall cap):
    once the parked reply's next token is late anyway, it displaces no runner (that would
    add the runner's miss to its own) until parked 30 TBT SLOs (3 s) past its last token."""
    sched, kv, d, reply = _parked_reply(None)
    last = reply.token_times[-1]  # TBT SLO 100 ms
    for wait in (0.3, 1.5, 2.95):
        plan = sched.schedule(last + wait)
        assert plan.rotate_out == [] and "runner" in plan.decode
    assert reply.status == RequestStatus.ROTARY
    assert sched.schedule(last + 3.05).rotate_out == ["runner"]


@pytest.mark.parametrize("step_s", [0.01, 0.06])
def test_by_default_a_late_parked_reply_is_back_within_two_tbt_slos(step_s):
    """The defaults (preset ``bounded``): a late parked reply rotates back in at once where
    the runner it displaces can come back on time (a 10 ms step), and on a slow device (a
    60 ms step, so displacing it costs the runner a gap) it waits for free pages only until
    parked 2 TBT SLOs past its last token."""
    sched, kv, d, reply = _parked_reply(None, step_s=step_s, preset="bounded")
    assert sched.policy.params == RotaSchedConfig(min_residency_tokens=4, residency_share=1.0)
    last = reply.token_times[-1]  # TBT SLO 100 ms
    if step_s == 0.01:
        assert sched.schedule(last + 0.15).rotate_out == ["runner"]
        return
    plan = sched.schedule(last + 0.15)
    assert plan.rotate_out == [] and "runner" in plan.decode
    assert sched.schedule(last + 0.21).rotate_out == ["runner"]


AUTO = {"parked_replies": "auto", "beta_b": 30.0, "reply_stall_cap": 5.0}


def test_auto_brings_a_late_reply_back_when_the_runner_it_displaces_can_come_back_too():
    """``auto``: a step (10 ms) and the round trip fit in the TBT SLO (100 ms), so
    displacing a runner costs it no gap: the parked reply whose next token is already late
    rotates back in at once, as under the paper's rule."""
    sched, kv, d, reply = _parked_reply(None, **AUTO)
    last = reply.token_times[-1]
    assert sched.schedule(last + 0.3).rotate_out == ["runner"]


def test_auto_on_a_slow_step_waits_at_most_the_stall_cap():
    """``auto`` on a device whose step (60 ms) and round trip exceed the TBT SLO (100 ms):
    displacing a runner would make its next token late too, so the late reply waits for
    free pages, but only until parked ``reply_stall_cap`` (5) TBT SLOs past its last
    token: then it is due, and displaces the runner."""
    sched, kv, d, reply = _parked_reply(None, step_s=0.06, **AUTO)
    last = reply.token_times[-1]
    for wait in (0.3, 0.45):
        plan = sched.schedule(last + wait)
        assert plan.rotate_out == [] and "runner" in plan.decode
    assert reply.status == RequestStatus.ROTARY
    assert sched.schedule(last + 0.51).rotate_out == ["runner"]


@pytest.mark.parametrize("mode", ["free_pages", "auto"])
def test_the_stall_cap_bounds_a_parked_replys_wait(mode):
    """With ``beta_b`` out of reach (30 TBT SLOs) and a slow step, the stall cap alone
    brings a late parked reply back: parked 2 TBT SLOs with a cap of 2, it is due."""
    sched, kv, d, reply = _parked_reply(mode, step_s=0.06, beta_b=30.0, reply_stall_cap=2.0)
    last = reply.token_times[-1]
    assert sched.schedule(last + 0.15).rotate_out == []
    assert sched.schedule(last + 0.21).rotate_out == ["runner"]


def test_a_late_parked_reply_takes_free_pages_before_a_late_first_token():
    """Before it lags, a parked reply whose next token is late anyway ranks ahead of the
    late first tokens but may take only pages no runner needs (``Ranking.free_only``).
    Pages free up (the runner leaves) with room for it or a late first token, not both:
    it is kept. Without room it is not kept, and no runner is dropped for it."""
    sched, kv, d, reply = _parked_reply("free_pages")
    now = reply.token_times[-1] + 0.3
    ranking = sched.policy.rank(sched, now)
    assert ranking.free_only == {id(reply)}
    sel = sched._select(ranking, StepBudget.full(sched.config))
    assert "reply" not in sel.keep and sel.dropped == []  # 3 free pages: one too few
    sched.remove(d.all["runner"])
    d.add(req("late", 16, arrival=now - 0.6))  # lag > 0, 4 pages
    assert kv.num_free_pages == 7  # the reply needs 4, "late" 4
    ranking = sched.policy.rank(sched, now)
    order = [r.req_id for r in ranking]
    assert order.index("reply") < order.index("late")
    sel = sched._select(ranking, StepBudget.full(sched.config))
    assert "reply" in sel.keep and "late" not in sel.keep and sel.dropped == []


def test_a_late_parked_reply_takes_no_runner_seat():
    """Free pages but every seat taken (``max_num_seqs`` 2, both seats running): the
    parked reply that does not lag yet is not kept, and no runner is dropped for its
    seat."""
    from superinfer_jax.sched.latency import LatencyModel

    rs = attainment(min_residency_tokens=4, residency_share=1.0, high_water_mark=0.01,
                         parked_replies="free_pages", beta_b=5.0)  # always contended
    sched, kv = make("rotasched", device_pages=20, host_pages=64, rotasched=rs,
                     enable_prefix_caching=False, max_num_seqs=2)
    d = Driver(sched, kv)
    d.add(req("runner", 8, arrival=0.0, max_tokens=40))
    d.add(req("reply", 8, arrival=0.0, max_tokens=40))
    for t in range(6):
        d.step(t * 0.01)
    d.add(req("new", 8, arrival=-0.6))  # late: takes the reply's seat
    assert d.step(0.06).rotate_out == ["reply"]
    sched.set_latency_model(LatencyModel(prefill=[0.01, 0.001, 0.0], decode=[0.01, 0.0, 0.0]))
    assert d.step(0.07).rotate_out == []  # not due (a 10 ms step and copy), not lagging
    reply = d.all["reply"]
    assert reply.status == RequestStatus.ROTARY and len(sched.running) == 2
    assert kv.num_free_pages >= 8  # pages for the reply, no seat
    now = reply.token_times[-1] + 0.3  # late whatever happens; lags only at + 0.5
    sel = sched._select(sched.policy.rank(sched, now), StepBudget.full(sched.config))
    assert "reply" not in sel.keep and sel.dropped == []


def test_rotasched_acts_from_the_high_water_mark_and_never_on_one_tier():
    """Contended at half the pool in use (the default mark), not below; never with a
    one-tier page manager, which has no host tier to park a request in (the engine's is
    always two-tier; a test that drives the scheduler with a plain one gets FCFS)."""
    from superinfer_jax.kv.page_allocator import KVCacheManager

    assert RotaSchedConfig().high_water_mark == 0.5
    for tiers in (2, 1):
        cfg = EngineConfig.build(page_size=PAGE, max_model_len=128, warmup=False,
                                 policy="rotasched")
        kv = TwoTierKVManager(1 + 20, PAGE, 64) if tiers == 2 else KVCacheManager(1 + 20, PAGE)
        sched = make_scheduler(cfg, kv)
        kv.allocate_for("a", 9 * PAGE)  # 9 of 20 usable pages: under the mark
        assert not sched.policy.contended(sched)
        kv.allocate_for("b", PAGE)  # 10 of 20: at the mark
        assert sched.policy.contended(sched) == (tiers == 2)


def _late_pair(order: str, *, latency=None, short: bool = True):
    """A settled runner holding 4 of 8 pages, then a long prompt (7 pages) and, 0.1 s
    later, a short one (2 pages), both late at 0.7 s: the pool takes only one of them.
    Returns the step's plan and the ranking after it."""
    sched, kv = make("rotasched", device_pages=8, host_pages=64, rotasched=attainment(
        min_residency_tokens=4, residency_share=1.0, late_order=order))
    d = Driver(sched, kv)
    d.add(req("run", 8, arrival=0.0, max_tokens=50))
    for i in range(6):  # prefill and five tokens: settled, far from its end
        d.step(0.01 * i)
    if latency is not None:
        sched.set_latency_model(latency)
    d.add(req("long", 28, arrival=0.0))
    if short:
        d.add(req("short", 8, arrival=0.1))
    plan = d.step(0.7)
    return plan, [r.req_id for r in sched.policy.rank(sched, 0.7)]  # the order after it


def test_late_first_tokens_go_shortest_first():
    """``late_order: shortest``: of two late first tokens the pool cannot both take, the
    shorter (later deadline) runs and the runner keeps its pages; by lag the longer one
    (earlier deadline) displaces the runner and the short one waits."""
    plan, _ = _late_pair("shortest")
    assert [rid for rid, _ in plan.prefill] == ["short"] and not plan.rotate_out
    plan, _ = _late_pair("lag")
    assert [rid for rid, _ in plan.prefill] == ["long"] and plan.rotate_out == ["run"]


def test_a_late_first_token_certain_to_miss_displaces_nobody():
    """``late_order: shortest``: a late first token whose own prefill (priced by the
    latency model) ends past its deadline ranks behind the runners, like one that has
    missed it; the runner is not rotated out for it. Unpriced, or by lag, it is."""
    from superinfer_jax.sched.latency import LatencyModel

    slow = LatencyModel(prefill=[0.01, 0.02, 0.0], decode=[0.01, 0.0, 0.0])  # 28: 0.57 s
    fast = LatencyModel(prefill=[0.01, 0.001, 0.0], decode=[0.01, 0.0, 0.0])  # 0.04 s
    plan, ranked = _late_pair("shortest", latency=slow, short=False)  # 0.7 + 0.57 > 1 s
    assert not plan.prefill and not plan.rotate_out
    assert ranked == ["run", "long"]  # still a candidate, behind the runner
    for order, lm in (("shortest", fast), ("shortest", None), ("lag", slow)):
        plan, _ = _late_pair(order, latency=lm, short=False)
        assert [rid for rid, _ in plan.prefill] == ["long"] and plan.rotate_out == ["run"]


def test_first_token_slack_prices_the_prefix_hit(monkeypatch):
    """The time to spare before a waiting request's TTFT deadline after its own prefill:
    the pages of its prefix hit are not prefilled (the rest is, after them), and its
    host-tier pages cost a transfer."""
    from superinfer_jax.sched.latency import LatencyModel
    from superinfer_jax.sched.rotasched.ranking import first_token_slack
    from superinfer_jax.sched.step_plan import PrefixHit

    sched, kv = make("rotasched", host_pages=64)
    lm = LatencyModel(prefill=[0.01, 0.001, 1e-5], decode=[0.01, 0.0, 0.0],
                      transfer=[0.002, 1e-6])
    sched.set_latency_model(lm)
    sched.page_bytes = 1000  # a host page: 2 + 1 ms
    r = req("r", 40, arrival=0.0)  # TTFT SLO 1 s
    sched.add(r)
    assert first_token_slack(sched, r, 0.3) == pytest.approx(0.7 - lm.prefill_s(40, 0))
    monkeypatch.setattr(sched, "prefix_hit", lambda q: PrefixHit(device=(1, 2), host=(3,)))
    # 3 pages of 4 tokens cached: 28 tokens to prefill after 12, one page copied in
    want = 0.7 - lm.prefill_s(28, 12) - 0.003
    assert first_token_slack(sched, r, 0.3) == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("due_order", ["lag", "stall"])
def test_due_replies_are_served_longest_parked_first_with_due_order_stall(due_order):
    """Two parked replies, both due (a stall cap of 0), neither lagging yet (``beta_b``
    30): by lag they tie and go by arrival, so the reply parked longest may wait behind a
    later one; ``due_order: stall`` ranks the longest parked first."""
    rs = attainment(parked_replies="free_pages", reply_stall_cap=0.0,
                         due_order=due_order)
    sched, _ = make("rotasched", device_pages=12, host_pages=64, rotasched=rs,
                    enable_prefix_caching=False)
    now = 10.0
    for rid, arrival, last in (("early_arrival", 1.0, 9.9), ("long_parked", 2.0, 9.2)):
        r = req(rid, 8, arrival=arrival, max_tokens=40)
        r.status = RequestStatus.ROTARY
        r.token_times.extend([arrival + 0.5, last])
        sched.rotary.append(r)
    order = [r.req_id for r in sched.policy.rank(sched, now)]
    expected = ["early_arrival", "long_parked"] if due_order == "lag" \
        else ["long_parked", "early_arrival"]
    assert order == expected


def test_prefill_stall_cap_bounds_the_step_of_a_late_first_token():
    """Without the cap a late first token's step takes the full token budget; with
    ``prefill_stall_cap`` it takes the largest chunk that keeps the step (decode call
    included) within that many TBT SLOs, never more than the configured budget, and at
    least the smallest bucket. A step whose decode call alone misses the TBT is capped the
    same way instead of taking the full budget."""
    from superinfer_jax.sched.latency import LatencyModel

    def budget_at(cap: float | None, decode_s: float, now: float) -> tuple[int, int]:
        sched, kv = make("rotasched", device_pages=64, host_pages=64,
                         rotasched=attainment(min_residency_tokens=4, high_water_mark=0.01,
                                                   prefill_stall_cap=cap))
        d = Driver(sched, kv)
        d.add(req("dec", 8, arrival=0.0, max_tokens=50))
        d.add(req("parked", 8, arrival=0.0, max_tokens=50))
        d.step(0.0)
        sched.force_rotate_out.add("parked")
        d.step(0.1)  # someone waits for memory: the TBT-sized budget applies
        sched.set_latency_model(LatencyModel(prefill=[0.010, 0.001, 0.0],
                                             decode=[decode_s, 0.0, 0.0]))
        d.add(req("new", 40, arrival=1.0, slo=SLO(ttft_ms=1000, tbt_ms=100)))
        return token_budget(sched, now, {"new"})

    full = (64, 64)
    assert budget_at(None, 0.06, 1.6) == full  # late: the configured budget
    # 100 ms: 60 decode + 10 + 16 fits, + 32 does not (102 ms)
    assert budget_at(1.0, 0.06, 1.6) == (1 + 16, 16)
    assert budget_at(1.5, 0.06, 1.6) == (1 + 32, 32)  # 150 ms: 32 fits (102 ms)
    assert budget_at(100.0, 0.06, 1.6) == (1 + 32, 32)  # 64 would pass the budget of 64
    assert budget_at(0.5, 0.06, 1.6) == (1 + 16, 16)  # nothing fits: the smallest bucket
    assert budget_at(None, 0.06, 1.2) == (1 + 16, 16)  # not late: TBT-sized, cap or not
    assert budget_at(1.0, 0.06, 1.2) == (1 + 16, 16)
    # the decode call alone (95 ms) misses 0.9 x TBT: the full budget, or capped
    assert budget_at(None, 0.095, 1.2) == full
    assert budget_at(1.2, 0.095, 1.2) == (1 + 16, 16)  # 120 - 95 = 25 ms: 16 (26 ms) no
    assert budget_at(1.4, 0.095, 1.2) == (1 + 32, 32)  # 45 ms: 32 (42 ms) fits


def test_parked_replies_are_capped_at_the_inbound_transfer_of_a_few_steps():
    """As ``parked_share``, counted in steps of the inbound transfer budget: with 16
    pages a step, ``parked_return_steps`` 0.25 allows 4 parked pages, so of two decoding
    runners the selection drops, the first rotates out (one parked reply is always
    allowed) and the second stays and keeps decoding; unset, both rotate out."""
    for steps, out in ((None, ["a", "b"]), (0.25, ["a"])):
        sched, kv = make("rotasched", device_pages=17, host_pages=64, rotasched=attainment(
            min_residency_tokens=4, residency_share=1.0, parked_return_steps=steps),
            enable_prefix_caching=False, transfer_budget_pages=16)
        d = Driver(sched, kv)
        d.add(req("a", 24, arrival=0.0, max_tokens=50))
        d.add(req("b", 24, arrival=0.0, max_tokens=50))
        for t in range(6):  # past their 4-token residency: 8 and 7 pages
            d.step(t * 0.1)
        for rid in ("new", "new2"):
            d.add(req(rid, 28, arrival=0.5, slo=SLO(ttft_ms=1000, tbt_ms=100)))
        plan = d.step(1.2)  # both late (past 0.5 + 0.5 * 1 s)
        assert plan.rotate_out == out
        assert plan.decode == [r for r in "ab" if r not in out]


def test_a_due_reply_kept_this_step_does_not_count_as_parked():
    """With a parked-page limit (``parked_return_steps`` 0.25 of 16 pages a step: 4
    pages), a reply due back swaps with the runner the selection drops: the reply comes
    back this step, so its 6 pages do not count against the limit and the runner (6
    pages) may take its place on the host (one parked reply is always allowed)."""
    sched, kv = make("rotasched", device_pages=17, host_pages=64, rotasched=attainment(
        min_residency_tokens=4, residency_share=1.0, parked_return_steps=0.25,
        reply_stall_cap=0.0), enable_prefix_caching=False, transfer_budget_pages=16)
    d = Driver(sched, kv)
    for rid in "abc":  # a and b hold 12 of the 16 pages; c waits for pages
        d.add(req(rid, 16, arrival=0.0, max_tokens=50))
    for t in range(6):
        d.step(t * 0.1)
    sched.force_rotate_out.add("a")
    plan = d.step(0.6)
    assert (plan.rotate_out, plan.rotate_in) == (["a"], ["c"])
    assert sched.policy.parked_page_limit(sched) == 4
    plan = d.step(0.7)  # a is due (stall cap 0): it displaces b, the runner ranked last
    assert (plan.rotate_out, plan.rotate_in) == (["b"], ["a"])
