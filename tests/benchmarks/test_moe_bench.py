"""benchmarks.moe's helpers on a tiny checkpoint: the Mixtral that transformers writes
loads as our MoE, the dense twin has its active parameters, the routing probe counts every
token's top-k, the bytes table's ratios, and the generate rows compare the same greedy
tokens. The benchmark itself (a dozen 4-layer compiles) is not run here:
``python -m benchmarks.moe --quick``."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.lib.moe_generate import MoEShape, dense_twin, generate_row, write_mixtral
from benchmarks.moe import routed_experts, step_bytes
from models import load_model
from models.config import MoEConfig
from models.servable import random_servable

SHAPE = MoEShape(experts=4, top_k=2, hidden=128, expert_size=32, layers=2, vocab=256)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_mixtral(tmp_path_factory.mktemp("moe_bench"), SHAPE)


@pytest.fixture(scope="module")
def moe(checkpoint):
    return load_model(checkpoint, dtype="float32")


def test_checkpoint_is_the_shape_and_the_twin_has_its_active_params(moe) -> None:
    cfg = moe.config
    assert cfg.moe == MoEConfig(num_experts=4, top_k=2, intermediate_size=32)
    assert (cfg.hidden_size, cfg.num_layers, cfg.vocab_size) == (128, 2, 256)
    dense = dense_twin(cfg)
    assert dense.moe is None and dense.intermediate_size == 2 * 32
    router = cfg.num_layers * cfg.hidden_size * 4
    assert dense.num_params() == cfg.num_params(active=True) - router


def test_routing_probe_counts_every_tokens_top_k(moe) -> None:
    counts = routed_experts(moe, batch=3, context=20)
    assert counts.shape == (2, 4)
    assert counts.sum(axis=1).tolist() == [3 * 2, 3 * 2]
    assert moe.expert_counts is None  # off again, as while timing


def test_bytes_ratios(moe) -> None:
    dense = random_servable(dense_twin(moe.config), dtype="float32")
    # batch 1: each layer routes to top_k experts, the bytes of the dense twin (plus the
    # router); ragged_dot would read all 4 experts, twice the routed two
    one = step_bytes(moe, dense, np.array([[1, 1, 0, 0], [0, 1, 0, 1]]), 1, 20)
    assert one["experts_routed"] == "2/2"
    assert one["ragged_read_over_routed"] == 2.0
    assert one["moe_over_dense_bytes"] == pytest.approx(1.0, abs=0.02)
    every = step_bytes(moe, dense, np.ones((2, 4), int), 8, 20)
    assert every["ragged_read_over_routed"] == 1.0
    assert every["routed_MB"] == pytest.approx(2 * one["routed_MB"], abs=0.02)  # MB to 2 places
    assert every["moe_over_dense_bytes"] > 1.2


def test_generate_row_engine_and_transformers_agree(checkpoint, moe) -> None:
    row = generate_row(checkpoint, moe, batch=2, prompt_len=8, new_tokens=6)
    assert (row["dtype"], row["batch"], row["new_tokens"]) == ("float32", 2, 6)
    assert row["engine_tok_s"] > 0 and row["hf_tok_s"] > 0
    # float32 on both sides, transformers' own random init: greedy tokens identical
    assert row["same_leading_tokens"] == 6
