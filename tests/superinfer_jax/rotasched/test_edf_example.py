"""``examples/edf_policy.py``: the earliest-deadline-first plug-in, named by its path, in
the scheduler, the simulator and the real engine (a tiny random model)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from superinfer_jax import LLMEngine, SamplingParams
from superinfer_jax.config import EngineConfig, RotaSchedConfig
from superinfer_jax.kv.two_tier import TwoTierKVManager
from superinfer_jax.request import SLO, Request, RequestStatus
from superinfer_jax.sched.rotasched import make_scheduler, resolve_policy
from superinfer_jax.sim import ConstantCost, RequestSpec, Simulator
from tests.superinfer_jax.engine_testlib import SMALL

EDF = "examples.edf_policy:EDFPolicy"
EDFPolicy = resolve_policy(EDF)  # imported by its path, as every command does
edf = sys.modules[EDFPolicy.__module__]


def test_rank_is_settling_runners_then_earliest_deadline():
    cfg = EngineConfig.build(page_size=4, max_model_len=64, warmup=False, policy=EDF,
                             rotasched=RotaSchedConfig(min_residency_tokens=2))
    sched = make_scheduler(cfg, TwoTierKVManager(32, 4, 32))
    assert isinstance(sched.policy, EDFPolicy)
    sp = SamplingParams(max_tokens=8)
    settling = Request("settling", [1, 2], sp, SLO(9000, 100), arrival_time=0.0)
    settled = Request("settled", [1, 2], sp, SLO(9000, 100), arrival_time=0.0)
    for r, tokens in ((settling, [1.0]), (settled, [0.5, 0.6, 0.7])):
        r.set_status(RequestStatus.RUNNING, 0.5)
        r.token_times.extend(tokens)
        sched.running.append(r)
    late = Request("late", [1, 2], sp, SLO(400, 100), arrival_time=0.5)  # due at 0.9
    early = Request("early", [1, 2], sp, SLO(100, 100), arrival_time=0.6)  # due at 0.7
    sched.add(late)
    sched.add(early)
    assert edf.deadline(settled) == pytest.approx(0.8)
    assert edf.deadline(early) == pytest.approx(0.7)
    ranked = [r.req_id for r in sched.policy.rank(sched, 1.0)]
    assert ranked == ["settling", "early", "settled", "late"]


def test_in_the_simulator_short_deadlines_pass_a_hog():
    """A long request holds most of the pool; short ones with a 20 ms TTFT arrive. FCFS
    makes them wait behind it; EDF rotates the hog out for them, and it comes back."""
    slo = SLO(ttft_ms=20, tbt_ms=100)
    specs = [RequestSpec(0.0, 36, 12, slo)] + [RequestSpec(0.02, 8, 2, slo) for _ in range(3)]
    worst, results = {}, {}
    for policy in ("fcfs", EDF):
        cfg = EngineConfig.build(page_size=4, max_model_len=48, warmup=False, policy=policy,
                                 max_num_batched_tokens=64, max_prefill_chunk=32,
                                 eager_shadowing=False,
                                 rotasched=RotaSchedConfig(min_residency_tokens=4))
        result = Simulator(cfg, ConstantCost(0.010, 0.005, 0.001), 13, 64).run(specs)
        assert all(r.status == RequestStatus.FINISHED_LENGTH for r in result.requests)
        worst[policy] = max(r.ttft for r in result.requests[1:])
        results[policy] = result
    assert worst[EDF] < worst["fcfs"]
    assert results[EDF].requests[0].num_rotations >= 1
    assert sum(r.num_rotations for r in results["fcfs"].requests) == 0


def test_in_the_engine_edf_keeps_the_greedy_tokens(tiny):
    """The real engine under memory pressure with EDF: every request rotates its way
    through and generates exactly the tokens of an unconstrained FCFS run."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 250, size=int(n)).tolist() for n in rng.integers(3, 30, 6)]
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    outputs = {}
    for name, cfg in (("free", SMALL), ("edf", SMALL.replace(
            num_device_pages=12, num_host_pages=128, policy=EDF,
            rotasched=RotaSchedConfig(high_water_mark=0.5, min_residency_tokens=4)))):
        engine = LLMEngine(tiny, cfg)
        ids = [engine.add_request(p, sp, slo=SLO(20 + 10 * i, 5)) for i, p in enumerate(prompts)]
        while engine.has_unfinished_requests():
            engine.step()
            engine.kv.check_invariants()
        outputs[name] = [engine.release(i) for i in ids]
    assert [r.output_token_ids for r in outputs["edf"]] == \
        [r.output_token_ids for r in outputs["free"]]
    assert sum(r.num_rotations for r in outputs["edf"]) > 0


def test_the_example_runs_as_a_module(capsys):
    edf.main()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6 and all("FINISHED_LENGTH" in line for line in lines)
    assert all("24 tokens" in line for line in lines)
    assert any(" 0 rotations" not in line for line in lines)
