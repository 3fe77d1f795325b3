"""The policy sweep's speculation settings (``benchmarks.lib.spec_sweep``): the flags, the
engine variants and their configs, and the per-setting summary's arithmetic on rows
built by hand; bad flags are refused by name before any model loads."""

from __future__ import annotations

import pytest

from benchmarks import policy_sweep
from benchmarks.lib import spec_sweep
from benchmarks.lib.spec_sweep import SpecSetting


def test_settings_and_variants():
    settings = spec_sweep.parse_settings("none,fixed:1,fixed:3,slo:5,fixed:3")
    assert [s.label for s in settings] == ["none", "fixed:1", "fixed:3", "slo:5"]
    assert SpecSetting().knobs() == {}
    assert SpecSetting("slo", 5).knobs() == {"speculative_method": "ngram",
                                             "num_speculative_tokens": 5,
                                             "speculative_mode": "slo"}
    got = spec_sweep.variants(["rotasched"], settings[:2], [8, 32])
    assert [(v.label, v.setting.label, v.max_num_seqs) for v in got] == [
        ("none seqs=8", "none", 8), ("fixed:1 seqs=8", "fixed:1", 8),
        ("none seqs=32", "none", 32), ("fixed:1 seqs=32", "fixed:1", 32)]
    # without --speculative and one max_num_seqs: the policy names, as before
    assert [v.label for v in spec_sweep.variants(["fcfs", "rotasched"], None, [16])] == \
        ["fcfs", "rotasched"]


def test_a_variant_config_carries_its_setting_and_batch_cap():
    from superinfer_jax.sim.presets import with_policy

    args = policy_sweep.build_parser().parse_args(["--max-prompt", "128"])
    v = spec_sweep.variants(["rotasched"], [SpecSetting("slo", 3)], [8])[0]
    config = with_policy(policy_sweep.engine_config(args, v.max_num_seqs,
                                                    **v.setting.knobs()), v.policy)
    assert config.engine.policy == "rotasched" and config.engine.max_num_seqs == 8
    assert (config.speculative.method, config.speculative.mode,
            config.speculative.num_tokens) == ("ngram", "slo", 3)
    assert policy_sweep.engine_config(args).speculative.method == "none"


@pytest.mark.parametrize("argv, message", [
    (["--speculative", "fixed:0"], "--speculative: 'fixed:0' is not none, fixed:K or slo:K"),
    (["--speculative", "eagle:3"], "--speculative: 'eagle:3' is not"),
    (["--max-num-seqs", "8,x"], "--max-num-seqs must be comma-separated integers"),
])
def test_bad_flags_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        policy_sweep.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def _row(setting: str, tbt: float, ttft: float, tput: float, seeds: list[tuple]) -> dict:
    return {"max_num_seqs": 8, "base_policy": "rotasched", "rate": 2.0,
            "speculative": setting, "tbt_att": tbt, "ttft_att": ttft, "out_tok_s": tput,
            "acceptance": 0.5, "per_seed": [{"seed": i, "tbt_att": a, "ttft_att": 1.0,
                                             "out_tok_s": t} for i, (a, t) in enumerate(seeds)]}


def test_summary_against_none_and_the_best_fixed_k():
    rows = [_row("none", 0.90, 0.80, 100.0, [(0.9, 100.0), (0.9, 100.0)]),
            _row("fixed:1", 0.92, 0.82, 110.0, [(0.94, 120.0), (0.90, 100.0)]),
            _row("fixed:3", 0.85, 0.70, 105.0, [(0.85, 105.0), (0.85, 105.0)]),
            _row("slo:5", 0.895, 0.81, 107.0, [(0.88, 118.0), (0.91, 96.0)])]
    out = spec_sweep.summary(rows)
    slo = next(r for r in out["rows"] if r["speculative"] == "slo:5")
    assert slo["best_fixed"] == "fixed:1"
    assert slo["tbt_pts_vs_none"] == pytest.approx(-0.5)
    assert slo["ttft_pts_vs_none"] == pytest.approx(1.0)
    assert slo["tput_vs_none"] == pytest.approx(1.07)
    assert slo["tput_vs_best_fixed"] == pytest.approx(107 / 110)
    assert slo["seed_tbt_pts_vs_none"] == pytest.approx([-2.0, 1.0])
    assert slo["seed_tput_vs_best_fixed"] == pytest.approx([118 / 120, 96 / 100])
    assert slo["met"] and out["met"]  # -0.5 points >= -1, 0.973x >= 0.97x
    assert "met" not in next(r for r in out["rows"] if r["speculative"] == "fixed:3")
    rows[3] = _row("slo:5", 0.88, 0.81, 107.0, [(0.88, 118.0), (0.88, 96.0)])
    out = spec_sweep.summary(rows)
    assert not out["met"] and "-2.0 points" in out["text"] and "NOT met" in out["text"]
