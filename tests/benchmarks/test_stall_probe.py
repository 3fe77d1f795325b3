"""``benchmarks.stall_probe``: its split of a request's longest gap covers the gap."""

from __future__ import annotations

import pytest

from benchmarks.stall_probe import Probe
from superinfer_jax.config import EngineConfig, RotaSchedConfig
from superinfer_jax.request import SLO
from superinfer_jax.sched import scheduler as sched_mod
from superinfer_jax.sim import ConstantCost, RequestSpec, Simulator


def test_the_split_of_each_longest_gap_adds_up_to_the_gap_and_the_hooks_come_out():
    """A contended RotaSched run that parks replies: for every request the seconds per
    state (running, parked, due, rotating, recomputing) add up to its longest gap, and
    the probe's hooks are gone after ``uninstall``."""
    cfg = EngineConfig.build(page_size=4, max_model_len=64, warmup=False, policy="rotasched",
                             max_num_batched_tokens=64, max_prefill_chunk=32, max_num_seqs=8,
                             rotasched=RotaSchedConfig(min_residency_tokens=2,
                                                       reply_stall_cap=2.0))
    slo = SLO(ttft_ms=40, tbt_ms=12)
    specs = [RequestSpec(0.003 * i, 8 + 4 * (i % 3), 6 + i % 5, slo) for i in range(16)]
    original = sched_mod.Scheduler.schedule
    probes = [Probe()]
    uninstall = Probe.install(probes)
    try:
        result = Simulator(cfg, ConstantCost(0.010, 0.005, 0.001), 20, 256).run(specs)
    finally:
        uninstall()
    assert sched_mod.Scheduler.schedule is original
    assert sum(r.num_rotations for r in result.requests) > 0  # replies were parked
    parked = 0.0
    for r in result.requests:
        times = list(r.token_times)
        if len(times) < 2:
            continue
        gap = max(b - a for a, b in zip(times, times[1:], strict=False))
        split = {k: v for k, v in probes[-1].split(r).items() if not k.startswith("(")}
        assert sum(split.values()) == pytest.approx(gap, abs=1e-9)
        parked += sum(v for k, v in split.items() if "parked" in k or "due" in k)
    assert parked > 0  # some longest gap was spent parked
