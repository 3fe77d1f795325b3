"""``superinfer simulate``: presets, the summary it prints, its errors."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from serving.cli import main as cli_main
from superinfer_jax.config import EngineConfig
from superinfer_jax.request import SLO
from superinfer_jax.sim import ConstantCost, RequestSpec, Simulator
from superinfer_jax.sim import stats as sim_stats
from superinfer_jax.sim.cost_model import HARDWARE
from superinfer_jax.sim.metrics import Timeline, summarize
from superinfer_jax.sim.presets import PRESETS, get_preset


def test_sim_summary_equals_the_benchmark_summary():
    """The simulator's numpy summary and ``sim.metrics.summarize`` agree exactly."""
    cfg = EngineConfig.build(page_size=4, max_model_len=64, warmup=False, policy="swap",
                             max_num_batched_tokens=64, max_prefill_chunk=32, max_num_seqs=4)
    slo = SLO(ttft_ms=30, tbt_ms=12)
    specs = [RequestSpec(0.004 * i, 6 + 5 * (i % 4), 3 + i % 5, slo) for i in range(12)]
    result = Simulator(cfg, ConstantCost(0.010, 0.005, 0.001), 24, 64).run(specs)
    timelines = [Timeline(r.arrival_time, list(r.token_times), len(r.prompt_token_ids),
                          r.slo.ttft_ms / 1000, r.slo.tbt_ms / 1000, r.num_rotations,
                          r.num_recomputed_tokens) for r in result.requests]
    want = summarize(timelines, result.duration_s)
    got = sim_stats.summarize(result)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12, nan_ok=True), key
    assert 0 < got["ttft_attainment"] < 1  # the scenario exercises both outcomes


def test_presets_build_simulators_with_paper_numbers():
    p = get_preset("paper-qwen32b-sharegpt")
    assert p.rates == (5, 10, 13, 15, 18, 20) and p.duration_s == 120
    assert (p.ttft_ms, p.tbt_ms) == (5000, 100)
    sim = p.simulator("gh200-96g", "rotasched")
    assert 4000 < sim.num_device_pages < 6000
    assert sim.num_host_pages == (400 << 30) // (16 * 262144)
    assert sim.latency is not None  # the slack mode's latency model, from the roofline
    assert set(PRESETS) >= {"paper-qwen32b-sharegpt", "paper-llama8b-sharegpt"}


def test_fp8_bytes_halve_weights_and_pages_at_the_same_flops():
    """``--weight-bytes 1 --kv-bytes 1``: half the weight bytes, half the page bytes, so
    the 96 GB GH200 holds far more pages; the FLOPs a step costs stay bf16's."""
    from superinfer_jax.sim.cost_model import StepWork, step_time

    bf16 = get_preset("paper-qwen32b-sharegpt")
    fp8 = dataclasses.replace(bf16, weight_bytes_per_param=1.0, kv_bytes_per_elem=1)
    a, b = bf16.model_shape, fp8.model_shape
    assert b.weight_bytes == a.weight_bytes / 2 and b.page_bytes(16) == a.page_bytes(16) // 2
    assert (b.num_params, b.active_params) == (a.num_params, a.active_params)
    pages = [p.simulator("gh200-96g", "fcfs").num_device_pages for p in (bf16, fp8)]
    # (0.9 x 96 GB - weights) / page: 22 GB of bf16 pages against 54 GB of half-size ones
    assert pages[1] > 4 * pages[0]
    # a prefill of 8192 tokens is compute-bound: the same time in both, unless the
    # weight matmuls run as FP8 GEMMs (--matmul-speedup 2): then they take half as long
    hw, work = HARDWARE["gh200-96g"], StepWork(8192, 0, 8192 * 4096)
    assert step_time(b, hw, work) == step_time(a, hw, work)
    gemm = dataclasses.replace(fp8, matmul_speedup=2.0).model_shape
    matmul_s = 2 * a.active_params * 8192 / (hw.compute_flops * hw.compute_efficiency)
    assert step_time(gemm, hw, work) == pytest.approx(step_time(a, hw, work) - matmul_s / 2)


def test_simulate_command_runs_a_small_sweep(tmp_path):
    out = tmp_path / "sim.json"
    rc = cli_main(["simulate", "--model", "qwen2.5-32b", "--dataset", "random",
                   "--hardware", "gh200-96g,h200-pcie", "--rates", "4,8",
                   "--policies", "fcfs,rotasched", "--num-requests", "40",
                   "--out", str(out), "--no-progress"])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 * 2 * 2
    for r in rows:
        assert r["summary"]["completed"] == 40 and math.isfinite(r["ttft_att"])
    assert (tmp_path / "sim.png").stat().st_size > 0


def test_simulate_this_machine_from_a_latency_profile(tmp_path):
    from superinfer_jax.sched.latency import LatencyModel

    profile = tmp_path / "profile.json"
    LatencyModel([0.02, 1e-3, 1e-6], [0.02, 2e-3, 5e-6], [0.0, 1e-10]).save(str(profile))
    out = tmp_path / "mine.json"
    rc = cli_main(["simulate", "--model", "smollm2-135m", "--dataset", "random", "--rates", "2",
                   "--num-requests", "12", "--latency-profile", str(profile),
                   "--num-device-pages", "48", "--num-host-pages", "64",
                   "--engine", "max_model_len=512", "--engine", "max_num_seqs=16",
                   "--engine", "max_num_batched_tokens=256", "--engine", "max_prefill_chunk=256",
                   "--out", str(out), "--no-progress"])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["hardware"] for r in rows} == {"this-machine"} and len(rows) == 3
    assert all(r["summary"]["num_device_pages"] == 48 for r in rows)


@pytest.mark.parametrize("argv, message", [
    (["--preset", "paper-gpt5"], "unknown preset"),
    (["--preset", "paper-llama8b-sharegpt", "--engine", "warp=9"], "EngineConfig field"),
    (["--preset", "paper-llama8b-sharegpt", "--hardware", "this-machine"],
     "needs a latency profile"),
    (["--preset", "paper-llama8b-sharegpt", "--latency-profile", "x.json"],
     "needs --num-device-pages"),
    (["--model", "llama-3-8b"], "give --preset, or --model, --dataset and --rates"),
    (["--preset", "paper-llama8b-sharegpt", "--hardware", "tpu-v9"], "hardware must be"),
    (["--preset", "paper-llama8b-sharegpt", "--policies", "lifo"], "policy must be one of"),
    (["--preset", "paper-llama8b-sharegpt", "--rates", "0"], "--rates must be positive"),
    (["--model", "gpt-9", "--dataset", "random", "--rates", "1"], "model must be one of"),
    (["--preset", "paper-qwen32b-sharegpt", "--kv-bytes", "3"], "--kv-bytes must be 1, 2 or 4"),
    (["--preset", "paper-qwen32b-sharegpt", "--weight-bytes", "0"],
     "--weight-bytes must be positive"),
    (["--preset", "paper-qwen32b-sharegpt", "--matmul-speedup", "-1"],
     "--matmul-speedup must be positive"),
])
def test_simulate_bad_arguments(argv, message, capsys):
    assert cli_main(["simulate", "--no-progress", *argv]) == 2
    assert message in capsys.readouterr().err
