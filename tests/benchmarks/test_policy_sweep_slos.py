"""The policy sweep's SLOs: multiples of the unloaded latencies (the first run left out,
the median of the rest), or fixed by flag; a bad fixed SLO is refused before any model
loads."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from benchmarks.policy_sweep import build_parser, main, slos, unloaded_latency


@dataclass
class _Done:
    ttft: float
    inter_token_gaps: list[float]


@dataclass
class ScriptedEngine:
    """Stands in for ``LLMEngine`` in ``unloaded_latency``: each request finishes at
    once with the next scripted TTFT and decode gaps (no model: the arithmetic is what
    is tested)."""

    ttfts: list[float]
    step_s: list[float]
    added: list[int] = field(default_factory=list)
    live: bool = False

    def add_request(self, prompt, params):
        self.added.append(len(prompt))
        self.live = True
        return str(len(self.added))

    def has_unfinished_requests(self) -> bool:
        return self.live

    def step(self):
        self.live = False
        return []

    def release(self, rid: str) -> _Done:
        i = int(rid) - 1
        return _Done(self.ttfts[i], [self.step_s[i]] * 7)


def test_unloaded_latency_leaves_out_the_first_run():
    # the first run is cold (10x); the median of the other 7 is the 4th smallest
    ttfts = [2.0, 0.25, 0.21, 0.28, 0.26, 0.22, 0.27, 0.24]
    steps = [0.3, 0.030, 0.025, 0.034, 0.027, 0.031, 0.029, 0.028]
    engine = ScriptedEngine(ttfts, steps)
    ttft, step = unloaded_latency(engine, prompt_len=105, vocab=1000)
    assert engine.added == [105] * 8
    assert ttft == pytest.approx(0.25) and step == pytest.approx(0.029)


def test_fixed_slos_replace_the_multiples():
    ttfts, steps = [0.5] + [0.2] * 7, [0.05] + [0.03] * 7
    args = build_parser().parse_args([])
    measured = slos(args, ScriptedEngine(ttfts, steps), 105, 1000)
    assert measured[:2] == pytest.approx((5 * 200.0, 3 * 30.0))  # --ttft-mult 5, --tbt-mult 3
    args = build_parser().parse_args(["--ttft-slo-ms", "1200", "--tbt-slo-ms", "90"])
    fixed = slos(args, ScriptedEngine(ttfts, steps), 105, 1000)
    assert fixed == pytest.approx((1200.0, 90.0, 0.2, 0.03))  # unloaded still reported
    args = build_parser().parse_args(["--tbt-slo-ms", "90"])
    assert slos(args, ScriptedEngine(ttfts, steps), 105, 1000)[:2] == \
        pytest.approx((1000.0, 90.0))


@pytest.mark.parametrize("flag", ["--ttft-slo-ms", "--tbt-slo-ms"])
def test_a_non_positive_fixed_slo_is_refused_by_name(flag, capsys):
    with pytest.raises(SystemExit) as e:
        main([flag, "0"])
    assert e.value.code == 2
    assert f"{flag} must be > 0" in capsys.readouterr().err


def test_a_policy_string_sets_the_policy_and_its_knobs():
    from superinfer_jax.config import EngineConfig
    from superinfer_jax.sim.presets import with_policy as policy_config

    base = EngineConfig.build(warmup=False)
    cfg = policy_config(base, "rotasched:parked_replies=auto:reply_stall_cap=5")
    assert cfg.engine.policy == "rotasched"
    assert (cfg.rotasched.parked_replies, cfg.rotasched.reply_stall_cap) == ("auto", 5)
    assert policy_config(base, "fcfs").rotasched == base.rotasched


def test_seeds_take_ranges_and_a_bad_list_is_refused_by_name(capsys):
    from benchmarks.lib.common import parse_seeds

    assert parse_seeds("0-11") == list(range(12))
    assert parse_seeds("0-2, 7") == [0, 1, 2, 7]
    with pytest.raises(SystemExit) as e:
        main(["--seeds", "0..11"])  # refused before the model loads
    assert e.value.code == 2
    assert "--seeds: expected" in capsys.readouterr().err
