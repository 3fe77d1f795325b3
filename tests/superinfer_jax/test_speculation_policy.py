"""The speculation-length policy (``sched.speculation``) against brute force and the
geometric acceptance law."""

from __future__ import annotations

import math
import random

import pytest

from superinfer_jax.sched.speculation import (
    AcceptanceEstimator,
    SpeculationPolicy,
    expected_tokens,
)

INF = float("inf")


def roofline(weights_s: float, per_token_s: float, overhead_s: float = 0.0):
    """A decode call: the larger of reading the weights and computing ``tokens``."""
    return lambda rows, tokens: overhead_s + max(weights_s, per_token_s * tokens)


def compute_bound(rows: int, tokens: int) -> float:
    return 0.002 + 0.001 * tokens


def test_expected_tokens_is_the_geometric_mean():
    """E(k) by enumeration: m accepted with P = a^m (1 - a) below k, a^k at k; m + 1
    tokens emitted."""
    for a in (0.0, 0.3, 0.77, 1.0):
        for k in range(7):
            probs = [a ** m * (1 - a) for m in range(k)] + [a ** k]
            want = sum(p * (m + 1) for m, p in enumerate(probs))
            assert expected_tokens(a, k) == pytest.approx(want, rel=1e-12, abs=1e-12)
    with pytest.raises(ValueError, match="k must be"):
        expected_tokens(0.5, -1)


def test_estimator_counts_acceptances_and_the_first_rejection():
    e = AcceptanceEstimator()
    e.update(5, 2)  # two accepted, a rejection at the third
    e.update(3, 3)  # all accepted: no rejection observed
    assert (e.alpha, e.beta) == (6.0, 2.0) and e.mean == 0.75
    with pytest.raises(ValueError, match="accepted"):
        e.update(2, 3)
    with pytest.raises(ValueError, match="alpha and beta"):
        AcceptanceEstimator(0.0, 1.0)


def test_estimator_converges_to_the_true_rate():
    """Truncated geometric draws at a = 0.7: the posterior mean is the maximum-likelihood
    rate (plus the prior), within 4 standard errors of a Bernoulli over the trials seen."""
    rng, a, e = random.Random(0), 0.7, AcceptanceEstimator()
    for _ in range(3000):
        m = 0
        while m < 4 and rng.random() < a:
            m += 1
        e.update(4, m)
    trials = e.alpha + e.beta - 2
    assert abs(e.mean - a) < 4 * math.sqrt(a * (1 - a) / trials)


def test_far_ahead_under_a_compute_bound_step_gets_no_speculation():
    policy = SpeculationPolicy("slo", 5)
    ks = policy.choose([0.9] * 64, [10.0] * 64, [100] * 64, compute_bound)
    assert ks == [0] * 64
    # the same rows on a memory-bound call (64 rows + proposals read the weights once)
    ks = policy.choose([0.9] * 64, [10.0] * 64, [100] * 64, roofline(0.03, 1e-4))
    assert min(ks) > 0


def test_batch_one_takes_the_k_of_most_tokens_per_second():
    """Against brute force over k = 0..K of E(a, k) / (other + step(1, 1 + k)) (the
    smallest k among ties), on roofline-shaped calls."""
    rng = random.Random(1)
    for _ in range(300):
        a = rng.uniform(0.05, 0.99)
        step = roofline(rng.uniform(0.005, 0.05), rng.uniform(1e-4, 2e-2),
                        rng.uniform(0.0, 0.005))
        other = rng.choice((0.0, rng.uniform(0.0, 0.02)))
        cap = rng.randint(1, 8)
        rate = [expected_tokens(a, k) / (other + step(1, 1 + k)) for k in range(cap + 1)]
        best = max(range(cap + 1), key=lambda k: (rate[k], -k))
        got = SpeculationPolicy("slo", cap).choose([a], [INF], [100], step, other)
        assert rate[got[0]] == pytest.approx(rate[best], rel=1e-12), (a, cap, got, best)


def test_high_acceptance_at_batch_one_speculates_deeply():
    assert SpeculationPolicy("slo", 5).choose([0.95], [INF], [100], roofline(0.02, 1e-4)) \
        == [5]


def test_no_row_misses_a_deadline_that_no_speculation_meets():
    rng = random.Random(2)
    step = roofline(0.02, 1e-3, 0.001)
    for _ in range(200):
        n = rng.randint(1, 24)
        acc = [rng.uniform(0.3, 1.0) for _ in range(n)]
        slack = [rng.uniform(0.0, 0.06) for _ in range(n)]
        ks = SpeculationPolicy("slo", 5).choose(acc, slack, [9] * n, step)
        base, spec = step(n, n), step(n, n + sum(ks))
        for s in slack:
            if s >= base:
                assert spec <= s
    # a row the plain call already misses does not stop the others' speculation
    assert SpeculationPolicy("slo", 3).choose([0.9, 0.9], [0.001, INF], [9, 9], step) \
        == [3, 3]


def test_row_limits_cap_k():
    ks = SpeculationPolicy("slo", 5).choose([0.99] * 3, [INF] * 3, [0, 2, -1],
                                            roofline(0.02, 1e-5))
    assert ks == [0, 2, 0]


def test_fixed_mode_returns_the_configured_k():
    policy = SpeculationPolicy("fixed", 3)
    assert policy.choose([0.0, 0.5, 1.0], [0.0, INF, -1.0], [10, 1, 3], compute_bound) \
        == [3, 1, 3]


@pytest.mark.parametrize("mode, k, message", [
    ("eager", 3, "mode must be one of"), ("slo", 0, "num_tokens must be in"),
    ("fixed", 17, "num_tokens must be in")])
def test_bad_policy(mode, k, message):
    with pytest.raises(ValueError, match=message):
        SpeculationPolicy(mode, k)
    with pytest.raises(ValueError, match="one entry per row"):
        SpeculationPolicy().choose([0.5], [], [1], compute_bound)


def test_requests_outside_the_call_keep_their_deadlines_too():
    """A prompt whose first token came from the step's prefill call waits for this call:
    its slack bounds the call like a row's; one the plain call misses does not."""
    def step(rows: int, tokens: int) -> float:
        return 0.04 + 1e-5 * tokens  # memory-bound: a proposal adds 10 us

    free = SpeculationPolicy("slo", 3).choose([0.9] * 20, [INF] * 20, [9] * 20, step)
    assert free == [3] * 20
    held = SpeculationPolicy("slo", 3).choose([0.9] * 20, [INF] * 20, [9] * 20, step,
                                              delayed_slack_s=[0.04031])
    assert sum(held) == 11 and step(20, 31) <= 0.04031 < step(20, 32)
    missed = SpeculationPolicy("slo", 3).choose([0.9] * 20, [INF] * 20, [9] * 20, step,
                                                delayed_slack_s=[0.03])
    assert missed == free
