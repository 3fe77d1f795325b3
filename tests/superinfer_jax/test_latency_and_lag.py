"""Latency model fits and virtual lag ordering, by hand-computable numbers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from superinfer_jax.config import RotaSchedConfig
from superinfer_jax.request import SLO, Request, RequestStatus, SamplingParams
from superinfer_jax.sched.latency import LatencyModel, fit_nonnegative
from superinfer_jax.sched.rotasched.lag import order_by_lag, virtual_lag


def test_fit_recovers_exact_linear_costs_and_persists(tmp_path):
    prefill = [(t, c, 0.002 + 1e-4 * t + 1e-8 * t * c) for t in (16, 64, 256) for c in (0, 512)]
    decode = [(b, ctx, 0.01 + 5e-4 * b + 2e-7 * ctx) for b in (1, 8, 32) for ctx in (64, 4096)]
    transfer = [(n, 1e-5 + n / 20e9) for n in (1 << 20, 16 << 20, 256 << 20)]
    lm = LatencyModel.fit(prefill, decode, transfer, model_name="m")
    assert lm.prefill_s(100, 300) == pytest.approx(0.002 + 1e-2 + 3e-4, rel=1e-6)
    assert lm.decode_s(16, 1000) == pytest.approx(0.01 + 8e-3 + 2e-4, rel=1e-6)
    assert lm.transfer_bandwidth == pytest.approx(20e9, rel=1e-6)
    assert lm.transfer_s(0) == 0.0
    lm.save(str(tmp_path / "p.json"))
    again = LatencyModel.load(str(tmp_path / "p.json"))
    assert again.decode_s(3, 5) == lm.decode_s(3, 5)


def test_fit_is_monotone_even_on_noisy_decreasing_data():
    x = np.stack([np.ones(4), np.array([1.0, 2, 3, 4])], 1)
    coef = fit_nonnegative(x, np.array([4.0, 3, 2, 1]))  # decreasing: slope clipped to 0
    assert coef[1] == 0.0 and coef[0] == pytest.approx(2.5)


def test_bad_profile_names_field(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"prefill": [0, -1, 0], "decode": [0, 0, 0],
                                "transfer": [0, 0]}))
    with pytest.raises(ValueError, match="prefill"):
        LatencyModel.load(str(path))
    (tmp_path / "junk.json").write_text("{nope")
    with pytest.raises(ValueError, match="unreadable"):
        LatencyModel.load(str(tmp_path / "junk.json"))


SLO_1S = SLO(ttft_ms=1000, tbt_ms=100)


def _req(rid, arrival, status, slo=SLO_1S, last_token=None,
         running_since=None):
    r = Request(rid, [1, 2], SamplingParams(), slo=slo, arrival_time=arrival)
    r.status = status
    r.running_since = running_since
    if last_token is not None:
        r.token_times.append(last_token)
    return r


def test_virtual_lag_by_hand():
    p = RotaSchedConfig(beta_b=0.0)  # the paper's constants: alpha 3, beta_f 0.5, beta_b 0
    now = 10.0
    waiting = _req("w", arrival=8.0, status=RequestStatus.WAITING)  # 2 s - 0.5 s
    assert virtual_lag(waiting, now, p) == pytest.approx(1.5)
    fresh = _req("f", arrival=9.8, status=RequestStatus.WAITING)
    assert virtual_lag(fresh, now, p) == 0.0
    rotary = _req("r", arrival=0.0, status=RequestStatus.ROTARY, last_token=9.6)
    assert virtual_lag(rotary, now, p) == pytest.approx(3 * 0.4)
    running = _req("x", arrival=0.0, status=RequestStatus.RUNNING, running_since=7.0)
    assert virtual_lag(running, now, p) == pytest.approx(-3.0)
    critical = _req("c", arrival=8.0, status=RequestStatus.WAITING,
                    slo=SLO(ttft_ms=1000, tbt_ms=100, priority_class="critical"))
    assert virtual_lag(critical, now, p) == pytest.approx(4 * 1.5)
    order = order_by_lag([running, fresh, waiting, rotary, critical], now, p)
    assert [r.req_id for r in order] == ["c", "w", "r", "f", "x"]


def test_no_lag_means_arrival_order():
    p = RotaSchedConfig()
    reqs = [_req(str(i), arrival=5.0 - i * 0.1, status=RequestStatus.WAITING) for i in range(4)]
    assert [r.req_id for r in order_by_lag(reqs, 5.05, p)] == ["3", "2", "1", "0"]


@pytest.mark.parametrize("kwargs, field", [
    ({"alpha": -1}, "alpha"), ({"beta_f": "x"}, "beta_f"),
    ({"priority_weights": {"vip": 2.0}}, "priority_weights"),
    ({"priority_weights": {"critical": 0, "standard": 1, "batch": 1}}, "critical"),
    ({"high_water_mark": 0}, "high_water_mark"), ({"mode": "edf"}, "mode"),
])
def test_bad_lag_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RotaSchedConfig(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    ({"ttft_ms": 0}, "ttft_ms"), ({"ttft_ms": -5}, "ttft_ms"), ({"tbt_ms": 1e12}, "tbt_ms"),
    ({"tbt_ms": float("inf")}, "tbt_ms"), ({"priority_class": "gold"}, "priority_class"),
    ({"ttft_ms": "fast"}, "ttft_ms"),
])
def test_bad_slo_names_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SLO(**kwargs)
