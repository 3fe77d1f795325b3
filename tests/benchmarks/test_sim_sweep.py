"""``benchmarks.lib.sim_sweep``'s pieces: policy strings with RotaSched knobs, the
conversation -> simulator spec mapping, pooled rows and the knee verdict."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.lib.sim_sweep import (
    engine_config,
    multiturn_verdict,
    parse_args,
    parse_seeds,
    pooled_row,
    to_conversation_specs,
    trace_specs,
)
from superinfer_jax.config import EngineConfig
from superinfer_jax.sim import ConstantCost, Simulator
from superinfer_jax.sim.conversations import Conversation
from superinfer_jax.sim.presets import split_policy as parse_policy


def test_policy_strings_carry_rotasched_knobs():
    assert parse_policy("fcfs") == ("fcfs", {})
    assert parse_policy("rotasched:residency_share=0.25:parked_replies=free_pages") == \
        ("rotasched", {"residency_share": 0.25, "parked_replies": "free_pages"})
    assert parse_policy("examples.edf_policy:EDFPolicy:beta_b=3") == \
        ("examples.edf_policy:EDFPolicy", {"beta_b": 3})
    assert parse_policy("rotasched:reply_stall_cap=none:hopeless_last=false") == \
        ("rotasched", {"reply_stall_cap": None, "hopeless_last": False})
    with pytest.raises(ValueError, match="not knob=value"):
        parse_policy("rotasched:no_such_knob=1")


def test_engine_config_applies_the_knobs(tmp_path):
    import argparse

    args = argparse.Namespace(max_prompt=256, max_output=48, device_pages=48, host_pages=512)
    cfg = engine_config(args, "rotasched:residency_share=0.25:beta_b=3")
    assert cfg.engine.policy == "rotasched" and cfg.rotasched.residency_share == 0.25
    assert cfg.rotasched.beta_b == 3 and cfg.prefix_caching.enabled
    assert cfg.model.max_model_len == 320 and cfg.hardware.num_device_pages == 48
    with pytest.raises(ValueError, match="residency_share"):
        engine_config(args, "rotasched:residency_share=2")


def test_seeds():
    assert parse_seeds("0-3") == [0, 1, 2, 3] and parse_seeds("4,7") == [4, 7]


def conversation() -> Conversation:
    return Conversation(index=0, start_s=0.5, head=(1,), user_ids=((2, 3, 4), (5, 6)),
                        reply_ids=((7, 8, 9), (10, 11)), think_s=(0.0, 0.25),
                        ttft_ms=900.0, tbt_ms=80.0)


def test_turns_spell_their_prompt_ids_and_keep_the_think_times():
    (spec,) = to_conversation_specs([conversation()])
    assert spec.start_s == 0.5 and spec.think_s == (0.0, 0.25)
    t0, t1 = spec.turns
    assert t0.hash_ids == (1, 2, 3, 4) and t0.block_tokens == 1 and t0.output_len == 3
    assert t1.hash_ids == (1, 2, 3, 4, 7, 8, 9, 5, 6) and t1.prompt_len == 9
    assert t1.slo.ttft_ms == 900.0 and t1.slo.tbt_ms == 80.0


def test_pooled_row_counts_every_turn_and_gap():
    cfg = EngineConfig.build(page_size=4, max_model_len=64, warmup=False, show_progress=False,
                             enable_prefix_caching=True)
    specs = to_conversation_specs([conversation()])
    # prefill 1 s: past the 900 ms TTFT SLO; decode 50 ms: within the 80 ms TBT SLO
    res = Simulator(cfg, ConstantCost(1.0, 0.05), 32, 0).run_conversations(specs)
    row = pooled_row("fcfs", 1.0, [res, res])
    assert row["requests"] == 4 and row["ttft_att"] == 0.0
    assert row["tbt_att"] == 1.0 and row["p99_tbt_ms"] == pytest.approx(50.0)
    assert row["rotations"] == 0


def test_verdict_reads_the_knee():
    rows = [{"policy": "fcfs", "rate": 1.0, "ttft_att": 0.7, "tbt_att": 0.9},
            {"policy": "fcfs", "rate": 2.0, "ttft_att": 0.5, "tbt_att": 0.9},
            {"policy": "rotasched", "rate": 2.0, "ttft_att": 0.8, "tbt_att": 0.86},
            {"policy": "x", "rate": 2.0, "ttft_att": 0.7, "tbt_att": 0.8}]
    lines = multiturn_verdict(rows)
    assert len(lines) == 2
    assert "knee 2 conv/s" in lines[0] and "1.60x" in lines[0] and lines[0].endswith(" met")
    assert "-10.0 points" in lines[1] and lines[1].endswith("NOT met")
    assert "add rates" in multiturn_verdict(rows[:1])[0]


def test_trace_requests_are_policy_sweeps():
    """The same sample, lengths and arrivals as ``policy_sweep`` builds for a seed."""
    from superinfer_jax.sim.workloads import load_trace, poisson_arrivals, scale_lengths

    args = parse_args(["--workload", "trace"])
    assert (args.ttft_slo_ms, args.tbt_slo_ms, args.rates) == (1096.0, 84.0, "0.5,1,2,3")
    specs = trace_specs(args, 2.0, 3)
    full = scale_lengths(load_trace("azure_conv", limit=256), 256, 48, 0.125)
    pick = np.random.default_rng(3).choice(len(full), 64, replace=False)
    arrivals = poisson_arrivals(64, 2.0, np.random.default_rng(4))
    assert len(specs) == 64
    assert [(s.prompt_len, s.output_len) for s in specs] == \
        [(full[i].prompt_len, full[i].output_len) for i in pick]
    assert [s.arrival_s for s in specs] == pytest.approx(list(arrivals))
    assert all(s.hash_ids is None and s.slo.ttft_ms == 1096.0 for s in specs)
