"""MoE models in the engine: greedy tokens never change under batch composition, forced
rotation to the host tier, recomputation, prefix-cache hits and chunked prefill (the
reference runs each request alone, with prefix caching off, on an engine with room).
TP = 2 and 4 with the experts sharded run in a subprocess on 4 virtual CPU devices
(``moe_tp_check``).

The engines here run without the per-expert counting callback (``expert_counts`` None):
it does not change what the step computes, and XLA's persistent cache does not keep
programs with host callbacks, so with it every engine would compile its steps again.
``test_engine_counts_tokens_per_expert`` runs one with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from models.servable import random_servable
from superinfer_jax import LLMEngine
from tests.models.moe_engine_lib import ENGINE, MODELS, prompts, run_alone, run_forced

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    servable = random_servable(MODELS[request.param], seed=3)
    servable.expert_counts = None  # see the module docstring
    return servable


@pytest.fixture(scope="module")
def reference(model) -> list[list[int]]:
    engine = LLMEngine(model, ENGINE.replace(num_device_pages=40, enable_prefix_caching=False))
    return run_alone(engine)


def test_rotation_batching_and_prefix_hits_keep_greedy_tokens(model, reference):
    engine = LLMEngine(model, ENGINE)
    done = run_forced(engine, every=3)
    assert [r.output_token_ids for r in done] == reference
    assert sum(r.num_rotations for r in done) >= 3
    assert sum(r.num_cached_tokens for r in done) > 0  # the extended prompts hit
    assert max(len(p) for p in prompts()) > ENGINE.engine.max_prefill_chunk  # chunked


def test_recomputation_keeps_greedy_tokens(model, reference):
    engine = LLMEngine(model, ENGINE.replace(num_host_pages=0))
    assert engine.duplex is None
    done = run_forced(engine, every=2)
    assert [r.output_token_ids for r in done] == reference
    assert sum(r.num_preemptions for r in done) >= 2


def test_engine_counts_tokens_per_expert():
    """The counts the metrics export: every token the engine computes (the prompt, then
    each generated token but the last), top_k times per routed layer; padding is not."""
    from superinfer_jax import SamplingParams

    model = random_servable(MODELS["qwen3_moe"], seed=3)
    engine = LLMEngine(model, ENGINE)
    prompt = prompts()[2]  # 23 tokens: a full chunk of 16, then 7 of 16 columns
    rid = engine.add_request(prompt, SamplingParams(max_tokens=5, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert len(engine.release(rid).output_token_ids) == 5
    counts = model.expert_counts.snapshot()
    assert counts.shape == (2, 8)  # layers 0 and 2 are routed
    assert (counts.sum(axis=1) == (len(prompt) + 4) * model.config.moe.top_k).all()


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("moe_tp") / "moe_tp.json"
    cmd = [sys.executable, "-m", "tests.models.moe_tp_check", "--devices", "4",
           "--out", str(out)]
    cache = jax.config.jax_compilation_cache_dir
    if cache:
        cmd += ["--cache-dir", cache]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("tp", ["2", "4"])
def test_expert_parallel_greedy_tokens_equal_one_device(tp_run, name, tp):
    runs = tp_run[name]
    assert tp_run["devices"] == 4
    assert runs[tp]["tokens"] == runs["1"]["tokens"]
    assert runs[tp]["rotations"] >= 3 and runs[tp]["cached_tokens"] > 0
    assert runs[tp]["expert_shard_shape"][0] == MODELS[name].moe.num_experts // int(tp)
    assert runs[tp]["counts"] == runs["1"]["counts"]  # routing is replicated: same counts
    assert runs[tp]["same_as_loaded"]  # loading onto the mesh == converting on device


def test_int8_experts_shard_and_keep_greedy_tokens(tp_run):
    """Mixtral with int8 weights, the quantized model converted to TP=2: TP=1's tokens
    with rotations and prefix hits; each device holds its experts' int8 weights and their
    per-channel scales [experts / 2, out]; the same arrays as the checkpoint loaded onto
    the mesh with ``quantization="int8"``."""
    runs = tp_run["mixtral_int8"]
    assert runs["2"]["tokens"] == runs["1"]["tokens"]
    assert runs["2"]["rotations"] >= 3 and runs["2"]["cached_tokens"] > 0
    moe = MODELS["mixtral"].moe
    assert runs["1"]["expert_dtype"] == runs["2"]["expert_dtype"] == "int8"
    assert runs["2"]["expert_shard_shape"] == [moe.num_experts // 2, 64, moe.intermediate_size]
    assert runs["2"]["scale_shard_shape"] == [moe.num_experts // 2, moe.intermediate_size]
    assert runs["2"]["counts"] == runs["1"]["counts"]
    assert runs["2"]["same_as_loaded"]


def test_experts_not_dividing_the_mesh_is_a_clear_error(tp_run):
    assert "num_experts (6) is not a multiple of tensor_parallel_size (4)" in \
        tp_run["indivisible_error"]


def test_int8_experts_are_quantized_and_keep_greedy_tokens_under_rotation():
    """``model.quantization: int8`` quantizes the stacked experts too (the router stays
    float32); within the mode, rotation, batching and prefix hits change no greedy token."""
    from models import quant

    model = random_servable(MODELS["mixtral"], seed=3, quantization="int8")
    model.expert_counts = None
    moe = model.params["layers"][0]["mlp"]
    assert isinstance(moe["we_gate"].get_value(), quant.QuantizedWeight)
    assert isinstance(moe["we_down"].get_value(), quant.QuantizedWeight)
    assert not isinstance(moe["router"].get_value(), quant.QuantizedWeight)
    alone = run_alone(LLMEngine(model, ENGINE.replace(num_device_pages=40,
                                                      enable_prefix_caching=False)))
    done = run_forced(LLMEngine(model, ENGINE), every=3)
    assert [r.output_token_ids for r in done] == alone
    assert sum(r.num_rotations for r in done) >= 3
