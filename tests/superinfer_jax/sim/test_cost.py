"""Cost models against hand arithmetic: roofline, link modes, page counts, calibration."""

from __future__ import annotations

import pytest

from superinfer_jax.config import EngineConfig, bucket
from superinfer_jax.sched.latency import LatencyModel
from superinfer_jax.sim import CalibratedCost, CallShape, HostOverhead, RooflineCost
from superinfer_jax.sim.cost import latency_model_of
from superinfer_jax.sim.cost_model import HARDWARE, MODELS, num_device_pages_for

CFG = EngineConfig.build(page_size=16, max_model_len=4096, max_num_seqs=256, warmup=False,
                         max_num_batched_tokens=2048, max_prefill_chunk=1024, max_prefill_rows=4)
LLAMA, GH200, PCIE = MODELS["llama-3-8b"], HARDWARE["gh200-96g"], HARDWARE["h200-pcie"]


def test_decode_is_bandwidth_bound_at_small_batch():
    cost = RooflineCost(LLAMA, GH200, CFG)
    s = cost.decode_call_s(CallShape(1, 1, 1, 1000, 1000, 1000))
    weights_s = LLAMA.weight_bytes / (GH200.hbm_bandwidth * GH200.bandwidth_efficiency)
    kv_s = 1001 * LLAMA.kv_bytes_per_token / (GH200.hbm_bandwidth * GH200.bandwidth_efficiency)
    assert s == pytest.approx(weights_s + kv_s + GH200.step_overhead_s)
    assert 6e-3 < s < 8e-3  # 16 GB of weights at 3.2 TB/s, plus 2 ms


def test_prefill_is_compute_bound_and_padding_costs():
    padded = RooflineCost(LLAMA, GH200, CFG, pad=True)
    ragged = RooflineCost(LLAMA, GH200, CFG, pad=False)
    shape = CallShape.of_rows([(300, 0), (20, 0)])  # two rows: [4, 512] once padded
    flops = 2 * LLAMA.num_params * 320
    assert ragged.prefill_call_s(shape) == pytest.approx(
        max(flops / (GH200.compute_flops * GH200.compute_efficiency),
            ragged.prefill_call_s(shape) - GH200.step_overhead_s) + GH200.step_overhead_s)
    ratio = (padded.prefill_call_s(shape) - GH200.step_overhead_s) / \
        (ragged.prefill_call_s(shape) - GH200.step_overhead_s)
    assert ratio == pytest.approx(4 * 512 / 320, rel=0.05)  # FLOPs of the padded tokens


def test_call_shape_counts():
    s = CallShape.of_rows([(4, 10), (1, 7)])
    assert (s.num_rows, s.max_query, s.num_tokens) == (2, 4, 5)
    assert s.kv_tokens_read == 14 + 8 and s.max_context == 14
    assert s.attn_pairs == (4 * 10 + 10) + (7 + 1)


def test_transfer_modes_reproduce_the_measured_bandwidths():
    """Naive per-layer copies ~10 GB/s; DuplexKV ~180 GB/s each way on GH200 (the paper:
    181 + 179); one way alone up to the 380 GB/s link; PCIe ~55 GB/s either way."""
    pages = 2400
    num_bytes = pages * LLAMA.page_bytes(16)
    gbps = {}
    for mode in ("naive", "simplex", "duplex"):
        cost = RooflineCost(LLAMA, GH200, CFG, transfer_mode=mode)
        gbps[mode] = num_bytes / cost.transfer_s(pages, duplex=True) / 1e9
    assert 8 < gbps["naive"] < 12
    assert 170 < gbps["duplex"] < 190
    assert 340 < gbps["simplex"] < 380  # the directions take turns, each at full rate
    pcie = RooflineCost(LLAMA, PCIE, CFG)
    assert 50 < num_bytes / pcie.transfer_s(pages, duplex=True) / 1e9 < 55


def test_device_pages_from_hbm_and_weights():
    pages = num_device_pages_for(LLAMA, GH200, 16, 0.9)
    free = 96e9 * 0.9 - LLAMA.weight_bytes
    assert pages == int(free // (16 * 131072)) + 1
    qwen = num_device_pages_for(MODELS["qwen2.5-32b"], GH200, 16)
    assert 4000 < qwen < 6000  # ~20 GB of KV left next to 65 GB of weights
    with pytest.raises(ValueError, match="does not fit"):
        num_device_pages_for(MODELS["qwen2.5-32b"], HARDWARE["h100-pcie"], 16, 0.5)


def test_calibrated_cost_prices_the_padded_buckets():
    lm = LatencyModel(prefill=[0.01, 1e-5, 1e-8], decode=[0.005, 1e-4, 1e-7],
                      transfer=[1e-4, 1e-9])
    cost = CalibratedCost(lm, CFG, page_bytes=1000, host=HostOverhead(0.002, 0.0001, 0.001))
    assert bucket(3, CFG.decode_buckets) == 4
    decode = CallShape(3, 1, 3, 300, 300, 120)  # padded to 4 rows, each at context 120
    assert cost.decode_call_s(decode) == pytest.approx(0.005 + 4e-4 + 1e-7 * 4 * 120)
    prefill = CallShape.of_rows([(100, 0), (30, 500)])  # [4 rows, 128 columns], context 530
    assert cost.prefill_call_s(prefill) == pytest.approx(0.01 + 4 * (1e-5 * 128
                                                                     + 1e-8 * 128 * 402))
    assert cost.host_s(5, 3) == pytest.approx(0.0025 + 0.003)
    assert cost.transfer_s(3, duplex=True) == pytest.approx(1e-4 + 3e-6)


def test_latency_model_of_a_roofline_predicts_it():
    cost = RooflineCost(LLAMA, GH200, CFG)
    lm = latency_model_of(cost, CFG)
    want = cost.decode_call_s(CallShape.of_rows([(1, 1023)] * 64))
    assert lm.decode_s(64, 64 * 1024) == pytest.approx(want, rel=0.1)
    assert lm.transfer_s(32 * cost.page_bytes) == pytest.approx(cost.transfer_s(32, False),
                                                                rel=0.05)


def test_bad_transfer_mode():
    with pytest.raises(ValueError, match="transfer_mode"):
        RooflineCost(LLAMA, GH200, CFG, transfer_mode="teleport")
