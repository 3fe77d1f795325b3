"""RotaSched's presets: the field defaults are the ``bounded`` preset, each preset sets
the same knobs (so naming one replaces another whole), ``attainment`` is the policy as it
was before the tail knobs, ``paper`` the paper's rule, and a policy string names a preset
as the deployment file does, its other knobs winning wherever they stand."""

from __future__ import annotations

import dataclasses

import pytest

from superinfer_jax.config import EngineConfig
from superinfer_jax.sched.rotasched_config import (
    DEFAULT_ROTASCHED_PRESET,
    ROTASCHED_PRESETS,
    RotaSchedConfig,
    rotasched_preset,
)
from superinfer_jax.sim.presets import split_policy, with_policy


def test_the_defaults_are_the_default_preset_and_every_preset_sets_the_same_knobs():
    assert RotaSchedConfig() == rotasched_preset(DEFAULT_ROTASCHED_PRESET)
    fields = {f.name for f in dataclasses.fields(RotaSchedConfig)}
    keys = {name: set(knobs) for name, knobs in ROTASCHED_PRESETS.items()}
    assert all(k == keys["bounded"] for k in keys.values()) and keys["bounded"] <= fields
    # every other knob is left at its own default by every preset
    for name in ROTASCHED_PRESETS:
        preset = rotasched_preset(name)
        for f in fields - keys[name]:
            assert getattr(preset, f) == getattr(RotaSchedConfig(), f), (name, f)


def test_attainment_is_the_policy_before_the_tail_knobs_and_paper_the_papers_rule():
    before = {"beta_b": 30.0, "late_order": "shortest", "parked_replies": "free_pages",
              "reply_stall_cap": None, "due_order": "lag", "hopeless_wait_cap": None,
              "residency_tbt_slos": None, "prefill_stall_cap": None,
              "pool_seat_fraction": None, "parked_return_steps": None}
    attainment = rotasched_preset("attainment")
    assert {k: getattr(attainment, k) for k in before} == before
    paper = rotasched_preset("paper")
    assert (paper.parked_replies, paper.beta_b, paper.late_order) == ("lag", 0.0, "lag")
    assert (paper.alpha, paper.beta_f) == (3.0, 0.5)
    bounded = RotaSchedConfig()
    assert bounded.pool_seat_fraction is not None and bounded.reply_stall_cap is not None
    assert bounded.hopeless_wait_cap is not None and bounded.parked_replies == "auto"


def test_overrides_win_over_the_preset_and_a_bad_name_is_refused_by_name():
    cfg = rotasched_preset("attainment", pool_seat_fraction=1.3, alpha=2.0)
    assert (cfg.pool_seat_fraction, cfg.alpha, cfg.parked_replies) == (1.3, 2.0, "free_pages")
    with pytest.raises(ValueError, match=r"rotasched.preset must be one of \['bounded', "
                                         r"'attainment', 'paper'\], got 'fastest'"):
        rotasched_preset("fastest")


@pytest.mark.parametrize("spec", ["rotasched:preset=paper:beta_b=2",
                                  "rotasched:beta_b=2:preset=paper"])
def test_a_policy_string_names_a_preset_wherever_it_stands(spec):
    name, knobs = split_policy(spec)
    assert name == "rotasched"
    assert knobs == {**ROTASCHED_PRESETS["paper"], "beta_b": 2}
    config = with_policy(EngineConfig.build(), spec)
    assert config.rotasched == rotasched_preset("paper", beta_b=2.0)
    assert with_policy(EngineConfig.build(), "rotasched").rotasched == RotaSchedConfig()
    with pytest.raises(ValueError, match=r"policy 'rotasched:preset=x': preset must be "
                                         r"one of \['bounded', 'attainment', 'paper'\]"):
        split_policy("rotasched:preset=x")
    with pytest.raises(ValueError, match="preset given twice"):
        split_policy("rotasched:preset=paper:preset=attainment")
