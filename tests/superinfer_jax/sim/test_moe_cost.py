"""The roofline of a mixture-of-experts model: expected experts touched against a Monte-
Carlo draw, parameter counts against the published ones, the step between its dense
bounds and monotone in batch, and the MoE presets' simulators."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from superinfer_jax.config import EngineConfig
from superinfer_jax.sim import CallShape, RooflineCost
from superinfer_jax.sim.cost_model import (
    HARDWARE,
    MODELS,
    ModelShape,
    StepWork,
    num_device_pages_for,
    step_time,
)
from superinfer_jax.sim.presets import get_preset

CFG = EngineConfig.build(page_size=16, max_model_len=4096, max_num_seqs=1024, warmup=False,
                         max_num_batched_tokens=4096, max_prefill_chunk=2048,
                         max_prefill_rows=4)
MOE = ("mixtral-8x7b", "mixtral-8x7b-fp8", "qwen3-30b-a3b", "qwen3-235b-a22b")


def distinct_experts_drawn(rng: np.random.Generator, num_experts: int, top_k: int,
                           num_tokens: int, trials: int) -> np.ndarray:
    """Per trial: the distinct experts ``num_tokens`` tokens touch, each token picking
    ``top_k`` different experts uniformly (the ``top_k`` smallest of fresh uniforms)."""
    keys = rng.random((trials, num_tokens, num_experts))
    chosen = np.argpartition(keys, top_k - 1, axis=-1)[..., :top_k]
    touched = np.zeros((trials, num_experts), dtype=bool)
    rows = np.arange(trials)[:, None, None]
    touched[rows, chosen] = True
    return touched.sum(axis=1)


@pytest.mark.parametrize("num_experts, top_k, num_tokens", [
    (8, 2, 1), (8, 2, 3), (8, 2, 8), (8, 2, 32), (8, 1, 5),
    (128, 8, 1), (128, 8, 4), (128, 8, 16), (128, 8, 64), (16, 2, 12),
])
def test_expected_experts_matches_a_monte_carlo_draw(num_experts, top_k, num_tokens):
    shape = ModelShape("m", 1, 64, 4, 4, 16, 0, 100, num_experts=num_experts,
                       experts_per_token=top_k, expert_intermediate_size=32)
    trials = 2000
    drawn = distinct_experts_drawn(np.random.default_rng(0), num_experts, top_k,
                                   num_tokens, trials)
    # the sample mean's standard error, 5 of them (about 1 in 2 million by chance)
    tol = 5 * drawn.std(ddof=1) / math.sqrt(trials) + 1e-9
    assert abs(drawn.mean() - shape.expected_experts(num_tokens)) <= tol
    assert top_k <= shape.expected_experts(num_tokens) <= num_experts


def test_parameter_counts_match_the_published_ones():
    """Model cards: Mixtral-8x7B 46.7B (12.9B active), Qwen3-30B-A3B 30.5B (3.3B),
    Qwen3-235B-A22B 235B (22B)."""
    def billions(name: str) -> tuple[float, float]:
        m = MODELS[name]
        return m.num_params / 1e9, m.active_params / 1e9

    assert billions("mixtral-8x7b") == pytest.approx((46.7, 12.9), abs=0.1)
    assert billions("qwen3-30b-a3b") == pytest.approx((30.5, 3.3), abs=0.1)
    assert billions("qwen3-235b-a22b") == pytest.approx((235.1, 22.2), abs=0.2)
    assert MODELS["mixtral-8x7b"].weight_bytes == pytest.approx(93.4e9, rel=1e-3)
    assert MODELS["mixtral-8x7b-fp8"].weight_bytes == MODELS["mixtral-8x7b"].weight_bytes / 2


def test_dense_models_read_all_their_weights():
    for name in ("llama-3-8b", "qwen2.5-32b", "llama-3-70b-fp8", "smollm2-135m"):
        m = MODELS[name]
        assert m.active_params == m.dense_params == m.num_params and m.expert_params == 0
        assert m.weight_bytes_read(1) == m.weight_bytes_read(512) == m.weight_bytes


def dense_bound(m: ModelShape, experts: int) -> ModelShape:
    """``m`` as a dense model whose MLP is ``experts`` experts wide (no router)."""
    return dataclasses.replace(m, name=f"{m.name}-dense{experts}", num_experts=0,
                               experts_per_token=0, expert_intermediate_size=0,
                               intermediate_size=experts * m.expert_intermediate_size)


@pytest.mark.parametrize("name", MOE)
@pytest.mark.parametrize("hw", ["gh200-144g", "h200-pcie"])
def test_moe_step_lies_between_its_dense_bounds(name, hw):
    """No cheaper than a dense model of its active parameters, no dearer than one of all
    of them (plus the router, which neither bound has); bytes of the active experts at
    one token, of all experts once a prefill's tokens cover them."""
    m, h = MODELS[name], HARDWARE[hw]
    active, total = dense_bound(m, m.experts_per_token), dense_bound(m, m.num_experts)
    router_share = m.num_layers * m.hidden_size * m.num_experts / m.num_params
    for tokens in (1, 2, 8, 32, 128, 1024, 4096):
        work = StepWork(tokens, 1000 * tokens, 1000 * tokens)
        t = step_time(m, h, work)
        assert step_time(active, h, work) <= t <= step_time(total, h, work) * (1 + router_share)
    router_bytes = m.num_layers * m.hidden_size * m.num_experts * m.weight_bytes_per_param
    assert m.weight_bytes_read(1) == pytest.approx(active.weight_bytes + router_bytes)
    assert m.weight_bytes_read(4096) == pytest.approx(m.weight_bytes)


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b"])
def test_moe_calls_are_monotone_in_batch(name):
    cost = RooflineCost(MODELS[name], HARDWARE["gh200-144g"], CFG, pad=False)
    decode = [cost.decode_call_s(CallShape.of_rows([(1, 999)] * b)) for b in range(1, 257)]
    assert all(a <= b for a, b in zip(decode, decode[1:], strict=False))
    assert decode[-1] > decode[0]  # the touched experts (then FLOPs) grow with the batch
    prefill = [cost.prefill_call_s(CallShape.of_rows([(n, 0)])) for n in range(1, 2049, 7)]
    assert all(a <= b for a, b in zip(prefill, prefill[1:], strict=False))


def test_bad_moe_shapes_name_the_field():
    with pytest.raises(ValueError, match="experts_per_token"):
        ModelShape("m", 1, 64, 4, 4, 16, 0, 100, num_experts=8, experts_per_token=9,
                   expert_intermediate_size=32)
    with pytest.raises(ValueError, match="expert_intermediate_size"):
        ModelShape("m", 1, 64, 4, 4, 16, 0, 100, num_experts=8, experts_per_token=2)


def test_mixtral_presets_fit_their_hardware():
    """bf16 Mixtral (93 GB) leaves ~36 GB of KV on the 144 GB GH200 and does not fit the
    96 GB one; its fp8 copy does."""
    kv_page = MODELS["mixtral-8x7b"].page_bytes(16)
    bf16 = get_preset("paper-mixtral8x7b-sharegpt")
    assert bf16.hardware == ("gh200-144g", "h200-pcie") and bf16.rates[0] == 5
    sim = bf16.simulator("gh200-144g", "rotasched")
    assert sim.num_device_pages == int((144e9 * 0.9 - 93.405052928e9) // kv_page) + 1
    assert sim.latency is not None
    with pytest.raises(ValueError, match="does not fit"):
        num_device_pages_for(MODELS["mixtral-8x7b"], HARDWARE["gh200-96g"], 16)
    fp8 = get_preset("paper-mixtral8x7b-fp8-sharegpt")
    assert fp8.simulator("gh200-96g", "fcfs").num_device_pages > 10000


def test_simulate_prints_the_mixtral_policy_table(tmp_path, capsys):
    from serving.cli import main as cli_main

    out = tmp_path / "mixtral.json"
    rc = cli_main(["simulate", "--preset", "paper-mixtral8x7b-sharegpt", "--rates", "4",
                   "--num-requests", "24", "--out", str(out), "--no-progress"])
    assert rc == 0
    table = capsys.readouterr().out
    assert "gh200-144g" in table and "h200-pcie" in table
    rows = json.loads(out.read_text())["rows"]
    assert {(r["hardware"], r["policy"]) for r in rows} == {
        (hw, p) for hw in ("gh200-144g", "h200-pcie") for p in ("fcfs", "swap", "rotasched")}
    assert all(r["summary"]["completed"] == 24 for r in rows)
