"""The simulator on tiny scenarios whose timelines are computed by hand.

Constant costs: a prefill call takes 10 ms, a decode call 5 ms, a page copy 1 ms. A step
is the prefill call then the decode call; prefill rows get their token when the first
call ends, decode rows when the second ends; the next step starts then.
"""

from __future__ import annotations

import gc

import pytest

from superinfer_jax.config import EngineConfig, RotaSchedConfig
from superinfer_jax.request import SLO, RequestStatus
from superinfer_jax.sim import ConstantCost, RequestSpec, Simulator
from superinfer_jax.sim.simulator import IN, OUT, Link

P, D, COPY = 0.010, 0.005, 0.001


def config(policy: str = "fcfs", **kw) -> EngineConfig:
    base = dict(page_size=4, max_model_len=64, warmup=False, policy=policy,
                max_num_batched_tokens=64, max_prefill_chunk=32, eager_shadowing=False,
                rotasched=RotaSchedConfig(min_residency_tokens=4))  # scenarios are short
    return EngineConfig.build(**{**base, **kw})


def run(specs, policy="fcfs", device_pages=64, host_pages=64, **kw):
    sim = Simulator(config(policy, **kw), ConstantCost(P, D, COPY), device_pages, host_pages)
    result = sim.run(specs)
    return result, {r.req_id: list(r.token_times) for r in result.requests}


def close(times: list[float], expected: list[float]) -> bool:
    return len(times) == len(expected) and all(abs(a - b) < 1e-12
                                               for a, b in zip(times, expected, strict=True))


def test_one_request_prefill_then_decodes():
    result, times = run([RequestSpec(1.0, 8, 4)])
    assert close(times["0"], [1.010, 1.015, 1.020, 1.025])
    req = result.requests[0]
    assert req.status == RequestStatus.FINISHED_LENGTH and req.ttft == pytest.approx(P)
    assert result.num_steps == 4 and result.duration_s == pytest.approx(0.025)
    assert (result.num_prefill_tokens, result.num_decode_tokens) == (8, 3)


def test_chunked_prefill_takes_one_step_per_chunk():
    _, times = run([RequestSpec(0.0, 40, 2)], max_prefill_chunk=16)
    assert close(times["0"], [0.030, 0.035])  # chunks of 16, 16, 8, then one decode


def test_two_requests_share_steps():
    _, times = run([RequestSpec(0.0, 8, 3), RequestSpec(0.0, 12, 3)])
    assert close(times["0"], [0.010, 0.015, 0.020])  # one prefill call with two rows
    assert close(times["1"], [0.010, 0.015, 0.020])


def test_a_mixed_step_delays_the_decode_rows():
    """B arrives during A's first decode step, so the next step is prefill B + decode A:
    B's token comes when the prefill call ends, A's when the decode call after it ends."""
    _, times = run([RequestSpec(0.0, 8, 4), RequestSpec(0.012, 8, 4)])
    assert close(times["0"], [0.010, 0.015, 0.030, 0.035])
    assert close(times["1"], [0.025, 0.035, 0.040, 0.045])


def test_idle_engine_waits_for_the_next_arrival():
    _, times = run([RequestSpec(0.0, 8, 2), RequestSpec(5.0, 8, 2)])
    assert close(times["1"], [5.010, 5.015])


CONTENDED = [RequestSpec(0.0, 8, 6), RequestSpec(0.0, 8, 6)]  # 5 usable pages of 4 tokens


def test_contention_under_fcfs_recomputes():
    """Both prefill (2 pages each). At step 2 each needs a third page; one is free: A
    takes it, B (the tail) is preempted and waits, since re-prefilling its 9 tokens
    needs 3 pages, until A finishes at 35 ms; then 9 tokens again (10 ms), 4 decodes."""
    result, times = run(CONTENDED, "fcfs", device_pages=6, max_model_len=20)
    assert close(times["0"], [0.010, 0.015, 0.020, 0.025, 0.030, 0.035])
    assert close(times["1"], [0.010, 0.045, 0.050, 0.055, 0.060, 0.065])
    b = result.requests[1]
    assert (b.num_preemptions, b.num_recomputed_tokens, b.num_rotations) == (1, 8, 0)


def test_contention_under_swap_rotates():
    """Same requests under swap: B is rotated out (2 pages, 2 ms) instead, comes back
    (2 ms) and is rotated out again whenever A needs the room; after the first trip its
    full pages keep their host copies, so later rotate-outs copy nothing. A finishes at
    35 ms; B's last rotate-in lands at 37 ms and it decodes its 5 tokens from there."""
    result, times = run(CONTENDED, "swap", device_pages=6, max_model_len=20)
    assert close(times["0"], [0.010, 0.015, 0.020, 0.025, 0.030, 0.035])
    assert close(times["1"], [0.010, 0.042, 0.047, 0.052, 0.057, 0.062])
    b = result.requests[1]
    assert (b.num_preemptions, b.num_recomputed_tokens, b.num_rotations) == (0, 0, 3)
    assert (result.pages_out, result.pages_in) == (2, 6)


def test_rotasched_without_contention_is_fcfs():
    specs = [RequestSpec(0.003 * i, 5 + 3 * i, 4 + i % 3) for i in range(8)]
    _, fcfs = run(specs, "fcfs")
    _, rota = run(specs, "rotasched")
    assert fcfs == rota


def test_rotasched_serves_short_requests_past_a_hog():
    """A long request holds most of the pool; short ones arriving later are served
    sooner under rotasched (it parks the hog) than under fcfs (they wait behind it)."""
    slo = SLO(ttft_ms=20, tbt_ms=100)
    # the shorts arrive while the hog is far from its end (it is not rotated out in its
    # last min_residency_tokens: it frees its pages soon by itself)
    specs = [RequestSpec(0.0, 36, 12, slo)] + [RequestSpec(0.02, 8, 2, slo) for _ in range(3)]
    worst = {}
    for policy in ("fcfs", "rotasched"):
        result, _ = run(specs, policy, device_pages=13, max_model_len=48)
        worst[policy] = max(r.ttft for r in result.requests[1:])
        assert all(r.status == RequestStatus.FINISHED_LENGTH for r in result.requests)
    assert worst["rotasched"] < worst["fcfs"]


def test_link_queues_per_direction_and_overlaps_directions():
    link = Link(ConstantCost(P, D, COPY, overlap=True))
    assert link.issue(OUT, 3, 0.0, other_active=True) == pytest.approx(0.003)
    assert link.issue(IN, 2, 0.0, other_active=True) == pytest.approx(0.002)  # side by side
    assert link.issue(OUT, 1, 0.001, other_active=False) == pytest.approx(0.004)  # FIFO
    assert link.issue(OUT, 0, 0.001, other_active=False) == pytest.approx(0.004)  # drains
    serial = Link(ConstantCost(P, D, COPY, overlap=False))
    assert serial.issue(OUT, 3, 0.0, other_active=True) == pytest.approx(0.003)
    assert serial.issue(IN, 2, 0.0, other_active=True) == pytest.approx(0.005)  # waits


def test_eager_shadows_use_the_link():
    sim = Simulator(config("swap", eager_shadowing=True), ConstantCost(P, D, COPY), 64, 64)
    result = sim.run([RequestSpec(0.0, 16, 3)])
    assert result.shadow_pages == 4  # the 4 full prompt pages, copied after the prefill
    assert result.link_busy_s[0] == pytest.approx(4 * COPY)
    assert result.pages_out == 4


@pytest.mark.parametrize("specs, message", [
    ([RequestSpec(1.0, 8, 2), RequestSpec(0.5, 8, 2)], "sorted by arrival_s"),
    ([RequestSpec(0.0, 64, 2)], "max_model_len"),
    ([RequestSpec(0.0, 0, 2)], "must be >= 1"),
])
def test_bad_workloads_are_refused(specs, message):
    with pytest.raises(ValueError, match=message):
        Simulator(config(), ConstantCost(P, D), 64).run(specs)


def test_a_pool_too_small_for_one_request_is_refused():
    with pytest.raises(ValueError, match="cannot hold one request"):
        Simulator(config(), ConstantCost(P, D), 10)


@pytest.mark.parametrize("enabled", [True, False])
def test_the_garbage_collector_is_off_during_a_run_and_restored_after(enabled):
    """The run switches the cyclic collector off (its passes over the live requests were
    16% of a contended run) and leaves it as it found it, also when the run raises."""
    seen: list[bool] = []

    def progress(_: int) -> None:
        seen.append(gc.isenabled())
        if len(seen) == 2:
            raise KeyboardInterrupt  # a caller's callback stopping the run midway

    sim = Simulator(config(), ConstantCost(P, D), 64)
    was = gc.isenabled()
    try:
        if enabled:
            gc.enable()
        else:
            gc.disable()
        with pytest.raises(KeyboardInterrupt):
            sim.run([RequestSpec(0.0, 8, 2), RequestSpec(0.0, 8, 3)], progress=progress)
        assert seen == [False, False]
        assert gc.isenabled() == enabled
        sim.run([RequestSpec(0.0, 8, 2)])
        assert gc.isenabled() == enabled
    finally:
        if was:
            gc.enable()
        else:
            gc.disable()
