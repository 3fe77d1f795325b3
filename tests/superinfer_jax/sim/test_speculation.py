"""Speculative decoding in the simulator: the acceptance law, timelines by hand, goodput,
and ``superinfer simulate --speculative``.

Constant costs as in ``test_simulator``: a prefill call takes 10 ms, a decode call 5 ms
(whatever it verifies), so a timeline with a known acceptance is computable by hand.
"""

from __future__ import annotations

import json

import pytest
from scipy.stats import chisquare

from serving.cli import main as cli_main
from superinfer_jax.config import EngineConfig
from superinfer_jax.request import SLO
from superinfer_jax.sched.speculation import SpeculationPolicy
from superinfer_jax.sim import ConstantCost, RequestSpec, Simulator
from superinfer_jax.sim import stats as sim_stats
from superinfer_jax.sim.presets import get_preset
from superinfer_jax.sim.speculation import SpecState, SpeculationSpec

P, D = 0.010, 0.005


def config() -> EngineConfig:
    return EngineConfig.build(page_size=4, max_model_len=64, warmup=False, policy="fcfs",
                              max_num_batched_tokens=64, max_prefill_chunk=32,
                              eager_shadowing=False)


def run(specs, speculation=None):
    sim = Simulator(config(), ConstantCost(P, D), 64, 0, speculation=speculation)
    return sim.run(specs)


def spec(text: str, rate: float) -> SpeculationSpec:
    return SpeculationSpec.parse(text, "measured", (rate,))


def test_accepted_tokens_follow_the_truncated_geometric_law():
    """m of k = 4 accepted at a = 0.6: P(m) = a^m (1 - a) for m < 4, a^4 at 4; 20,000
    seeded draws, every expected bin count far above 5."""
    a, k, n = 0.6, 4, 20000
    state = SpecState(spec("fixed:4", a))
    state.add("r")
    counts = [0] * (k + 1)
    for _ in range(n):
        counts[state.accepted("r", k)] += 1
    probs = [a ** m * (1 - a) for m in range(k)] + [a ** k]
    assert min(p * n for p in probs) >= 5
    assert chisquare(counts, [p * n for p in probs]).pvalue > 0.001


def test_beta22_rates_have_the_beta_mean_and_variance():
    state = SpecState(SpeculationSpec(SpeculationPolicy("fixed", 1), "beta22", seed=3))
    for i in range(4000):
        state.add(str(i))
    rates = list(state.rate.values())
    mean = sum(rates) / len(rates)
    var = sum((r - mean) ** 2 for r in rates) / len(rates)
    # Beta(2, 2): mean 1/2, variance 1/20; standard error of the mean sqrt(0.05 / 4000)
    assert abs(mean - 0.5) < 4 * (0.05 / 4000) ** 0.5 and abs(var - 0.05) < 0.005


def test_each_request_draws_the_same_under_every_policy():
    """Paired runs: a request's rate and its acceptance draws come from its own RNG (the
    run's seed and its id), whatever the policy and whatever was drawn before."""
    one = SpecState(SpeculationSpec.parse("fixed:1", "beta22", seed=7))
    two = SpecState(SpeculationSpec.parse("slo:5", "beta22", seed=7))
    for i in range(20):
        one.add(str(i))
    for i in reversed(range(20)):
        two.add(str(i))
        two.accepted(str(i), 5)  # another request's draws in between
    assert one.rate == two.rate
    three = SpecState(SpeculationSpec.parse("slo:5", "beta22", seed=7))
    three.add("3")
    assert [one.accepted("3", 4) for _ in range(50)] == \
        [three.accepted("3", 4) for _ in range(50)]
    other = SpecState(SpeculationSpec.parse("fixed:1", "beta22", seed=8))
    other.add("3")
    assert other.rate["3"] != one.rate["3"]


def test_all_accepted_emits_one_plus_k_tokens_per_decode_call():
    """Prompt 8, 7 tokens, fixed:2 at a = 1: the prefill call's token at 10 ms, then
    three tokens per decode call at 15 and 20 ms."""
    result = run([RequestSpec(0.0, 8, 7)], spec("fixed:2", 1.0))
    assert list(result.requests[0].token_times) == [0.010] + [0.015] * 3 + [0.020] * 3
    s = sim_stats.summarize(result)
    assert (s["spec_num_drafts"], s["spec_num_draft_tokens"],
            s["spec_num_accepted_tokens"]) == (2, 4, 4)
    assert s["spec_num_accepted_tokens_per_pos"] == [2, 2] and s["spec_acceptance_rate"] == 1


def test_the_last_step_proposes_only_what_is_left():
    """Output 4 at fixed:5, a = 1: after the first token, one call verifies 1 + 2."""
    result = run([RequestSpec(0.0, 8, 4)], spec("fixed:5", 1.0))
    assert list(result.requests[0].token_times) == [0.010] + [0.015] * 3
    assert result.num_decode_tokens == 3


def test_nothing_accepted_is_the_run_without_speculation():
    specs = [RequestSpec(0.002 * i, 6 + i, 3 + i % 4) for i in range(8)]
    plain = run(specs)
    rejected = run(specs, spec("fixed:3", 0.0))
    assert [list(r.token_times) for r in rejected.requests] == \
        [list(r.token_times) for r in plain.requests]


def test_goodput_by_hand():
    """Both at a = 1, fixed:2, arriving together: tokens at 10 ms, then 3 at 15 ms and 3
    at 20 ms; gaps 5, 0, 0, 5, 0, 0 ms. A (TBT 6 ms) meets both SLOs, B (TBT 4 ms)
    misses; the run lasts 20 ms, so goodput is 1 / 0.020 requests per second."""
    a = RequestSpec(0.0, 8, 7, SLO(ttft_ms=50, tbt_ms=6))
    b = RequestSpec(0.0, 8, 7, SLO(ttft_ms=50, tbt_ms=4))
    s = sim_stats.summarize(run([a, b], spec("fixed:2", 1.0)))
    assert s["duration"] == pytest.approx(0.020)
    assert s["request_goodput"] == pytest.approx(1 / 0.020)
    assert s["slo_attainment"] == 0.5 and s["tbt_attainment"] == pytest.approx(10 / 12)


def test_seeded_runs_repeat():
    specs = [RequestSpec(0.001 * i, 6 + i, 9) for i in range(10)]
    sp = SpeculationSpec.parse("slo:4", "beta22", seed=5)
    one, two = run(specs, sp), run(specs, sp)
    assert [list(r.token_times) for r in one.requests] == \
        [list(r.token_times) for r in two.requests]


def _sweep(tmp_path, name: str, *extra: str) -> list[dict]:
    out = tmp_path / f"{name}.json"
    assert cli_main(["simulate", "--model", "qwen2.5-32b", "--dataset", "random",
                     "--hardware", "gh200-96g", "--rates", "8", "--policies", "rotasched",
                     "--num-requests", "40", "--out", str(out), "--no-progress",
                     *extra]) == 0
    return json.loads(out.read_text())["rows"]


def test_simulate_with_speculation_off_equals_without_the_option(tmp_path):
    plain = _sweep(tmp_path, "plain")
    rows = _sweep(tmp_path, "spec", "--speculative", "none,fixed:3,slo:5",
                  "--acceptance", "beta22,measured")
    assert [(r["spec"], r["accept"]) for r in rows] == [
        ("none", "-"), ("fixed:3", "beta22"), ("slo:5", "beta22"), ("fixed:3", "measured"),
        ("slo:5", "measured")]
    drop = ("sim_wall_s",)
    want = {k: v for k, v in plain[0]["summary"].items() if k not in drop}
    got = {k: v for k, v in rows[0]["summary"].items() if k not in drop}
    assert got == want and "spec" not in plain[0] and "goodput" not in plain[0]
    for r in rows[1:]:
        s = r["summary"]
        assert s["completed"] == 40 and s["spec_num_draft_tokens"] > 0
        assert r["goodput"] == s["request_goodput"]


@pytest.mark.parametrize("argv, message", [
    (["--speculative", "eager:3"], "mode must be one of"),
    (["--speculative", "fixed:x"], "expected fixed:K or slo:K"),
    (["--speculative", "fixed:40"], "num_tokens must be in"),
    (["--speculative", "slo:3", "--acceptance", "gauss"], "acceptance must be one of"),
    (["--speculative", "slo:3", "--acceptance", "measured", "--acceptance-rates", "1.5"],
     "acceptance rates must be in"),
    (["--speculative", "slo:3", "--acceptance", "measured", "--acceptance-rates",
      "/nonexistent/rates.json"], "cannot read a 'rates' list from /nonexistent/rates.json"),
])
def test_simulate_bad_speculation(argv, message, capsys):
    assert cli_main(["simulate", "--no-progress", "--preset", "paper-llama8b-sharegpt",
                     *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_policy_never_prices_a_call_under_its_true_price():
    """``call_seconds`` against the roofline's price of the exact ragged shape (``1 + k``
    tokens per row): equal without proposals, never lower with them."""
    import random

    from superinfer_jax.sim import CallShape
    from superinfer_jax.sim.speculation import call_seconds

    sim = get_preset("paper-llama8b-sharegpt").simulator("gh200-96g", "fcfs")
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 400)
        contexts = [rng.randint(1, 8000) for _ in range(n)]
        ks = [rng.randint(0, 5) for _ in range(n)]
        step_s = call_seconds(contexts, 5, sim.cost)
        plain = sim.cost.decode_call_s(CallShape.of_rows([(1, c) for c in contexts]))
        true = sim.cost.decode_call_s(CallShape.of_rows(
            [(1 + k, c) for k, c in zip(ks, contexts, strict=True)]))
        assert step_s(n, n) == pytest.approx(plain, rel=1e-12)
        assert step_s(n, n + sum(ks)) >= true * (1 - 1e-12)


def test_measured_rates_are_the_committed_n_gram_runs(tmp_path):
    """The default ``measured`` rates: the data file's per-request rates, each in [0, 1],
    with how they were made; ``--acceptance-rates FILE.json`` reads another such file."""
    import argparse
    from importlib import resources

    from superinfer_jax.sim.cli import add_arguments, speculations
    from superinfer_jax.sim.speculation import MEASURED_RATES, load_measured_rates

    data = json.loads(resources.files("superinfer_jax.sim").joinpath(
        "data", "ngram_acceptance.json").read_text())
    assert MEASURED_RATES == tuple(data["rates"]) and len(MEASURED_RATES) >= 8
    assert all(0.0 <= a <= 1.0 for a in MEASURED_RATES)
    assert {"command", "commit", "k"} <= set(data["source"])
    assert sum(len(kind["rates"]) for kind in data["per_kind"].values()) == len(data["rates"])
    assert SpeculationSpec.parse("slo:3", "measured").measured_rates == MEASURED_RATES
    path = tmp_path / "rates.json"
    path.write_text(json.dumps({"rates": [0.25, 0.75]}))
    assert load_measured_rates(str(path)) == (0.25, 0.75)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--speculative", "fixed:3", "--acceptance", "measured",
                              "--acceptance-rates", str(path)])
    (spec,) = speculations(args)
    assert spec is not None and spec.measured_rates == (0.25, 0.75)
