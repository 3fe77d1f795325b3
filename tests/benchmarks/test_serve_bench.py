"""The serving benchmark: its arithmetic on scripted timestamps, and real streams from fake
servers on loopback (gRPC and OpenAI HTTP) whose timing is known."""

from __future__ import annotations

import argparse
import asyncio
import json

import numpy as np
import pytest

from serving.bench import cli as serve_bench
from serving.cli import main as cli_main
from superinfer_jax.sim.metrics import Timeline, summarize, vllm_goodput
from superinfer_jax.sim.workloads import WorkloadSpec, build_workload
from tests.benchmarks.fake_servers import FIRST_S, GAP_S


def scripted() -> list[Timeline]:
    slo = {"ttft_slo_s": 1.0, "tbt_slo_s": 0.15}
    return [
        Timeline(0.0, [0.5, 0.6, 0.7, 0.8], 10, **slo),  # meets both
        Timeline(1.0, [3.0, 3.2], 20, **slo),  # TTFT 2 s and a 200 ms gap: misses both
        Timeline(2.0, [2.3], 30, **slo),  # one token: meets TTFT, no gap to miss
        Timeline(3.0, [], 40, ok=False, **slo),  # failed
    ]


def test_metrics_from_scripted_timestamps():
    s = summarize(scripted(), duration_s=4.0)
    assert (s["completed"], s["failed"], s["total_output_tokens"]) == (3, 1, 7)
    assert s["total_input_tokens"] == 60
    assert s["mean_ttft_ms"] == pytest.approx((500 + 2000 + 300) / 3)
    assert s["median_ttft_ms"] == pytest.approx(500)
    assert s["mean_itl_ms"] == pytest.approx(125)  # gaps 100, 100, 100, 200
    assert s["median_itl_ms"] == pytest.approx(100)
    assert s["p99_itl_ms"] == pytest.approx(100 + 0.97 * 100)  # linear, rank 2.97 of 0..3
    assert s["mean_tpot_ms"] == pytest.approx(150)  # (100 + 200) / 2; one-token excluded
    assert s["mean_e2el_ms"] == pytest.approx((800 + 2200 + 300) / 3)
    assert s["ttft_attainment"] == 0.5  # 2 of 4 requests (the failed one counts)
    assert s["tbt_attainment"] == 0.75  # 3 of 4 gaps
    assert s["slo_attainment"] == 0.5
    assert s["request_goodput"] == pytest.approx(2 / 4.0)
    assert s["request_throughput"] == pytest.approx(3 / 4.0)
    assert s["output_throughput"] == pytest.approx(7 / 4.0)


def test_vllm_goodput_and_chunked_token_counts():
    t = scripted()
    assert vllm_goodput(t, 4.0, ttft_ms=1000, tpot_ms=150) == pytest.approx(2 / 4)
    assert vllm_goodput(t, 4.0, ttft_ms=1000, tpot_ms=150, e2el_ms=500) == pytest.approx(1 / 4)
    assert vllm_goodput(t, 4.0) == pytest.approx(3 / 4)  # no bound: every completed one
    chunky = Timeline(0.0, [0.5, 0.9], 8, num_output_tokens=5)  # 2 chunks, 5 tokens
    s = summarize([chunky], 1.0)
    assert s["total_output_tokens"] == 5
    assert s["mean_tpot_ms"] == pytest.approx(400 / 4)
    assert s["mean_itl_ms"] == pytest.approx(400)  # one gap between chunks, as vLLM


def bench_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve_bench.add_arguments(p)
    return p.parse_args(["--no-progress", *argv])


def by_hand(records) -> dict[str, float]:
    """The same numbers, computed directly from what the client recorded."""
    ttft = [r.chunk_times[0] - r.send_time for r in records]
    itl = [b - a for r in records for a, b in zip(r.chunk_times, r.chunk_times[1:],
                                                   strict=False)]
    tpot = [(r.chunk_times[-1] - r.chunk_times[0]) / (r.output_tokens - 1) for r in records]
    return {"mean_ttft_ms": 1000 * sum(ttft) / len(ttft),
            "median_ttft_ms": 1000 * float(np.median(ttft)),
            "p99_itl_ms": 1000 * float(np.percentile(itl, 99)),
            "mean_itl_ms": 1000 * sum(itl) / len(itl),
            "mean_tpot_ms": 1000 * sum(tpot) / len(tpot),
            "max_ttft": max(ttft), "min_ttft": min(ttft), "median_itl": float(np.median(itl))}


def run_fake(backend: str, target: str, n: int = 3, output_len: int = 4, rate: float = 20.0):
    args = bench_args("--backend", backend, "--target", target)
    workload = build_workload(WorkloadSpec(dataset="random", num_requests=n, rate=rate,
                                           random_input_len=8, random_output_len=output_len,
                                           seed=1))
    records, duration, info = asyncio.run(serve_bench.measure(args, target, workload))
    result = serve_bench.result_of(serve_bench.timelines_of(records, workload), duration,
                                   records, {})
    return workload, records, result, info


@pytest.mark.parametrize("backend", ["grpc", "openai"])
def test_benchmark_against_scripted_server(backend, fake_grpc, fake_http):
    target = fake_grpc if backend == "grpc" else fake_http
    workload, records, result, info = run_fake(backend, target)
    assert info["model"] == "fake"
    assert all(r.ok and r.output_tokens == 4 for r in records)
    hand = by_hand(records)
    for key in ("mean_ttft_ms", "median_ttft_ms", "p99_itl_ms", "mean_itl_ms", "mean_tpot_ms"):
        assert result[key] == pytest.approx(hand[key], rel=1e-12), key
    # ... and those numbers are the server's script, up to scheduling noise.
    assert FIRST_S - 1e-3 <= hand["min_ttft"] and hand["max_ttft"] < FIRST_S + 0.15
    assert GAP_S * 0.5 < hand["median_itl"] < GAP_S + 0.05
    assert result["output_lens"] == [4, 4, 4]
    assert result["num_rotations"] == (3 if backend == "grpc" else 6)
    sent = np.array([r.send_time for r in records]) - records[0].send_time
    arrivals = np.array([w.arrival_s for w in workload])
    # requests leave at their arrival times: never early, and late by well under the
    # workload's span (a loaded machine delays a send by tens of milliseconds)
    assert (sent >= arrivals - 1e-3).all() and (sent - arrivals).max() < 0.25
    assert result["ttft_attainment"] == 1.0 and result["failed"] == 0


def test_http_errors_count_as_failed(fake_http):
    workload, records, result, _ = run_fake("openai", fake_http, n=2, output_len=60)
    assert result["failed"] == 2 and result["completed"] == 0
    assert all("HTTP 400" in r.error and "max_tokens" in r.error for r in records)


def test_a_warming_server_is_refused_before_any_request(fake_http, monkeypatch):
    from tests.benchmarks.fake_servers import SSEHandler

    monkeypatch.setattr(SSEHandler, "warming_up", True)
    with pytest.raises(ValueError, match="not serving yet"):
        run_fake("openai", fake_http)


def test_cli_sweep_writes_json_and_plots(fake_grpc, tmp_path):
    out = tmp_path / "bench.json"
    rc = cli_main(["bench", "--target", fake_grpc, "--dataset", "random",
                   "--random-input-len", "8", "--random-output-len", "3", "--num-requests",
                   "4", "--rates", "20,40", "--goodput", "ttft:1000", "tpot:100",
                   "--out", str(out), "--no-progress"])
    assert rc == 0
    data = json.loads(out.read_text())
    assert [r["rate"] for r in data["rows"]] == [20.0, 40.0]
    res = data["rows"][0]["result"]
    for key in ("mean_ttft_ms", "p99_itl_ms", "request_throughput", "ttfts", "itls",
                "ttft_attainment", "request_goodput", "request_goodput_vllm"):
        assert key in res, key
    assert (tmp_path / "bench-cdf.png").stat().st_size > 0
    assert (tmp_path / "bench-attainment.png").stat().st_size > 0


@pytest.mark.parametrize("argv, message", [
    (["--rates", "-1"], "--rates must be positive"),
    (["--rates", "fast"], "--rates must be comma-separated numbers"),
    (["--dataset", "nope"], "dataset must be one of"),
    (["--slo-mix", "1:vip:100:10"], "priority_class"),
    (["--goodput", "latency:5"], "--goodput keys are"),
    (["--policies", "fcfs"], "--policies needs --launch"),
    (["--arrival", "trace", "--dataset", "random"], "arrival 'trace' needs a trace"),
    (["--target", "127.0.0.1:9", "--dataset", "random"], "unreachable"),
])
def test_bad_arguments_get_clear_errors(argv, message, capsys, tmp_path):
    rc = cli_main(["bench", "--no-progress", "--out", str(tmp_path / "x.json"), *argv])
    assert rc == 2
    assert message in capsys.readouterr().err
