"""Mooncake traces in the simulator: hash ids as prompt content, the replay's arrivals,
the unbounded-cache ceiling, and ``superinfer simulate`` reporting hit rates."""

from __future__ import annotations

import json

import pytest

from serving.cli import main as cli_main
from superinfer_jax.config import EngineConfig
from superinfer_jax.sim import ConstantCost, RequestSpec, Simulator
from superinfer_jax.sim.mooncake import BlockTrace, is_block_trace, load_block_trace
from superinfer_jax.sim.presets import get_preset
from superinfer_jax.sim.stats import prefix_hit_ceiling, summarize

# Two conversations of three turns (each turn extends its conversation's ids) and one
# lone request; timestamps in ms, 5 s apart.
TRACE = [
    (0, 1000, 20, [0, 1]), (5000, 700, 20, [0, 2]), (10000, 1600, 20, [0, 1, 3, 4]),
    (15000, 1500, 20, [0, 2, 5]), (20000, 2100, 20, [0, 1, 3, 4, 6]),
    (25000, 2000, 30, [0, 2, 5, 7]), (30000, 300, 0, [9]),
]


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "conv.jsonl"
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": o,
                                        "hash_ids": ids}) + "\n" for t, n, o, ids in TRACE))
    return path


def test_block_traces_are_recognised(trace, tmp_path):
    assert is_block_trace("mooncake_conv") and is_block_trace(str(trace))
    assert not is_block_trace("azure_conv") and not is_block_trace("sharegpt")
    plain = tmp_path / "plain.jsonl"
    plain.write_text('{"timestamp": 0, "input_length": 5, "output_length": 2}\n')
    assert not is_block_trace(str(plain))


def test_replay_scales_the_timestamps_and_keeps_leading_ids(trace):
    specs, notes = load_block_trace(BlockTrace(str(trace), max_prompt=1024))
    assert [s.arrival_s for s in specs] == [5.0 * i for i in range(7)]
    assert [s.prompt_len for s in specs] == [1000, 700, 1024, 1024, 1024, 1024, 300]
    assert specs[2].hash_ids == (0, 1) and specs[0].hash_ids == (0, 1)
    assert specs[6].output_len == 1  # output_length 0: one token, as the engine gives
    assert "4 cut to 1024" in notes[0]
    # the trace records 6 / 30 s = 0.2 req/s: at 1 req/s it plays 5 times as fast
    fast, _ = load_block_trace(BlockTrace(str(trace), rate=1.0, num_requests=3))
    assert [s.arrival_s for s in fast] == [0.0, 1.0, 2.0]
    window, _ = load_block_trace(BlockTrace(str(trace), rate=1.0, duration_s=4.5))
    assert len(window) == 5


def run(specs, caching=True, device_pages=512):
    cfg = EngineConfig.build(page_size=16, max_model_len=4096, warmup=False, policy="fcfs",
                             max_num_batched_tokens=2048, max_prefill_chunk=1024,
                             enable_prefix_caching=caching)
    return Simulator(cfg, ConstantCost(0.010, 0.005, 0.001), device_pages, 256).run(specs)


def test_an_unbounded_cache_reaches_the_ceiling(trace):
    specs, _ = load_block_trace(BlockTrace(str(trace), max_prompt=4095))
    ceiling = prefix_hit_ceiling(specs, 16)
    # each turn reuses the full pages of its conversation's previous turn (1000 tokens:
    # 62 pages); the first two share block 0
    hits = [0, 512, 992, 688, 1600, 1488, 0]
    assert ceiling == pytest.approx(sum(hits) / sum(s.prompt_len for s in specs))
    result = run(specs)  # requests end long before the next arrives: nothing evicted
    assert [r.num_cached_tokens for r in result.requests] == hits
    assert summarize(result)["prefix_hit_rate"] == pytest.approx(ceiling)
    small = run(specs, device_pages=260)  # room for one request: older pages evicted
    assert summarize(small)["prefix_hit_rate"] <= ceiling
    assert prefix_hit_ceiling([RequestSpec(0.0, 64, 1)] * 2, 16) == 0  # no content


def test_simulate_reports_hit_rates_with_caching_on_and_off(trace, tmp_path):
    out = tmp_path / "mc.json"
    rc = cli_main(["simulate", "--model", "llama-3-8b", "--dataset", str(trace),
                   "--hardware", "gh200-96g", "--rates", "1", "--policies", "fcfs,swap",
                   "--engine", "max_model_len=4096", "--out", str(out), "--no-progress"])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["policy"], r["cache"]) for r in rows] == \
        [("fcfs", "on"), ("fcfs", "off"), ("swap", "on"), ("swap", "off")]
    for r in rows:
        assert r["summary"]["completed"] == len(TRACE)
        assert (r["hit_rate"] > 0.3) == (r["cache"] == "on") and 0 <= r["slo_att"] <= 1
        assert 0 <= r["host_hit"] <= r["hit_rate"] + 1e-9
    one = tmp_path / "one.json"
    assert cli_main(["simulate", "--model", "llama-3-8b", "--dataset", str(trace),
                     "--hardware", "gh200-96g", "--rates", "1", "--policies", "fcfs",
                     "--prefix-caching", "off", "--engine", "max_model_len=4096",
                     "--out", str(one), "--no-progress"]) == 0
    assert [r["cache"] for r in json.loads(one.read_text())["rows"]] == ["off"]


def test_the_mooncake_preset_is_the_paper_comparison():
    p = get_preset("paper-llama8b-mooncake-conv")
    assert p.hardware == ("gh200-144g", "h200-pcie", "gh200-96g", "h100-nvl-pcie")
    assert p.num_requests == 3000 and p.engine.model.max_model_len == 32768
    sim = p.simulator("h100-nvl-pcie", "rotasched")
    assert sim.config.prefix_caching.enabled and sim.num_device_pages > 2 * 2048
