"""The policy sweep's verdict at the knee: the first rate where the baseline meets at
most 60% of first tokens, its goals judged there, and the P99 TTFT ratio reported beside
them without deciding the verdict."""

from __future__ import annotations

from benchmarks.policy_sweep import knee_verdict


def _row(policy: str, rate: float, ttft_att: float, p99_ttft_ms: float,
         p99_tbt_ms: float = 200.0) -> dict:
    return {"policy": policy, "rate": rate, "ttft_att": ttft_att, "tbt_att": 0.9,
            "out_tok_s": 100.0, "p99_tbt_ms": p99_tbt_ms, "mean_ttft_ms": 500.0,
            "p99_ttft_ms": p99_ttft_ms}


def test_the_knee_is_the_first_rate_at_or_under_sixty_percent_and_p99_ttft_is_reported():
    rows = [_row("fcfs", 2.0, 0.7, 2000.0), _row("rotasched", 2.0, 0.95, 2100.0),
            _row("fcfs", 3.0, 0.5, 3000.0), _row("rotasched", 3.0, 0.9, 7500.0),
            _row("fcfs", 4.0, 0.3, 5000.0), _row("rotasched", 4.0, 0.8, 5000.0)]
    verdict = knee_verdict(rows)
    assert verdict["rate"] == 3.0
    assert verdict["ttft_ratio"] == 0.9 / 0.5
    assert verdict["p99_ttft_ratio"] == 7500.0 / 3000.0
    assert "P99 TTFT 2.50x" in verdict["text"]
    assert verdict["met"]  # a long first-token tail is reported, not judged


def test_a_p99_tbt_past_one_and_a_half_times_the_baseline_fails_the_knee():
    rows = [_row("fcfs", 3.0, 0.5, 3000.0), _row("rotasched", 3.0, 0.9, 3000.0, 301.0)]
    verdict = knee_verdict(rows)
    assert verdict["p99_tbt_ratio"] == 301.0 / 200.0
    assert not verdict["met"] and "NOT met" in verdict["text"]
