"""Tensor parallelism: head layouts by hand here, and on 4 virtual CPU devices in a
subprocess (``tp_check``): TP=2 and TP=4 give TP=1's greedy tokens with rotations
running and with prefix-cache hits in either tier, host pages are split per device in
pinned host memory, and the compiled step holds the Megatron collectives and nothing
that moves the KV pool.

Each sharded engine is a set of step compiles (seconds each, 30 layers for SmolLM2), so
each model runs only the sizes that check something of its own (``tp_check.CASE_TPS``):
the Llama with 8 KV heads (a plain split) at TP=2 and TP=4; SmolLM2 (padded heads) at
TP=4, loaded from GGUF into the sharded layout, with the one-device model converted to
that layout compared to it tensor by tensor; the replicated-KV model at TP=4 (at TP=2 it
is a plain split, its QKV bias covered there by the sink case's logits). SmolLM2 and the
replicated model run one request at a time, a token per step: one compiled step shape
per engine; llama8 batches four and prefills in chunks. llama8 with fp8_e4m3 KV pages at
TP=2 gives its TP=1 tokens, the calibrated scales sharded with their KV heads; llama8 with
int8 weights at TP=2 gives its TP=1 tokens, the per-channel scales split with their
columns."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh

from models.config import PRESETS, ModelConfig
from models.sharding import ShardPlan, plan_heads
from superinfer_jax import EngineConfig, LLMEngine
from superinfer_jax.dist.parallel import make_mesh
from tests.numerics import assert_close, f32_tolerance

REPO = Path(__file__).resolve().parents[2]
# (case, TP size) of every sharded engine tp_check runs.
SHARDED = [("smollm2", 4), ("llama8", 2), ("llama8", 4), ("replicated", 4)]


def _config(heads: int, kv_heads: int, ffn: int = 64) -> ModelConfig:
    return ModelConfig(name="t", vocab_size=64, hidden_size=32, intermediate_size=ffn,
                       num_layers=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=4)


# -- head layouts, by hand ------------------------------------------------------------------

@pytest.mark.parametrize("heads, kv, tp, want_kv, want_heads, replicas", [
    (9, 3, 2, 4, 12, 1),  # SmolLM2: one zero KV head with its 3 zero query heads
    (9, 3, 4, 4, 12, 1),
    (32, 8, 2, 8, 32, 1),  # Llama-3-8B: split as is
    (32, 8, 8, 8, 32, 1),
    (32, 8, 16, 16, 32, 2),  # each KV head on two shards, its group of 4 split in 2
    (6, 2, 4, 4, 8, 2),  # groups of 3 split 2 + 1 (one zero query head per copy)
    (8, 1, 4, 4, 8, 4),  # MQA: the one KV head on every shard
    (40, 8, 8, 8, 40, 1),  # Qwen2.5-32B
])
def test_head_layout(heads, kv, tp, want_kv, want_heads, replicas):
    layout = plan_heads(_config(heads, kv), tp)
    assert (layout.num_kv_heads, layout.num_heads, layout.kv_replicas) == (
        want_kv, want_heads, replicas)


@pytest.mark.parametrize("heads, kv, tp", [
    (h, k, t) for k, g, t in itertools.product((1, 2, 3, 4, 5, 8), (1, 2, 3, 4, 5), (2, 3, 4, 8))
    for h in [k * g]])
def test_every_head_keeps_its_kv_head(heads, kv, tp):
    """Query head ``h`` of the sharded model reads KV head ``h // G'``; that KV head must
    be a copy of the one its original head read, every original head must be served,
    and both counts must split evenly over the mesh."""
    cfg = _config(heads, kv)
    lay = plan_heads(cfg, tp)
    assert lay.num_kv_heads % tp == 0 and lay.num_heads % tp == 0
    group = lay.num_heads // lay.num_kv_heads
    for h, src in enumerate(lay.q_source):
        if src >= 0:
            assert lay.kv_source[h // group] == src // cfg.num_queries_per_kv
    assert sorted(s for s in lay.q_source if s >= 0) == list(range(heads))
    assert sorted(s for s in lay.kv_source if s >= 0) == sorted(list(range(kv)) * lay.kv_replicas)


def test_weights_are_moved_by_whole_heads_and_padded_with_zeros():
    cfg = _config(heads=9, kv_heads=3, ffn=30)  # ffn 30 over 4 shards pads to 32
    plan = ShardPlan(cfg, AbstractMesh((4,), ("tp",)))
    d, hd = cfg.hidden_size, cfg.head_dim
    wq = np.random.default_rng(0).standard_normal((d, 9 * hd)).astype(np.float32)
    out = plan.transform(("layers", 0, "attn", "wq"), wq).reshape(d, 12, hd)
    for h, src in enumerate(plan.layout.q_source):
        want = wq.reshape(d, 9, hd)[:, src] if src >= 0 else 0
        np.testing.assert_array_equal(out[:, h], want)
    wo = wq.T.copy()
    assert (plan.transform(("layers", 0, "attn", "wo"), wo).reshape(12, hd, d)[9:] == 0).all()
    down = np.ones((30, d), np.float32)
    padded = plan.transform(("layers", 0, "mlp", "w_down"), down)
    assert padded.shape == (32, d) and padded[30:].sum() == 0 and padded[:30].all()
    norm = np.ones(d, np.float32)
    assert plan.transform(("layers", 0, "attn_norm", "weight"), norm) is norm


@pytest.mark.parametrize("name", ["wq", "wk", "wo", "w_gate", "w_down"])
def test_quantized_weights_move_like_quantizing_the_moved_weight(name):
    """A quantized weight converted to a padded layout (``transform`` of ``q``,
    ``transform_scale`` of its scales) equals the converted float weight quantized:
    selected columns take their scales along, zero columns get scale 1, and a row
    selection (wo, w_down) leaves the scales as they are."""
    from models import quant

    cfg = _config(heads=9, kv_heads=3, ffn=30)  # 3 KV heads -> 4, ffn 30 -> 32 over 4
    plan = ShardPlan(cfg, AbstractMesh((4,), ("tp",)))
    shapes = {"wq": (32, 36), "wk": (32, 12), "wo": (36, 32), "w_gate": (32, 30),
              "w_down": (30, 32)}
    path = ("layers", 0, "attn" if name[0] == "w" and name[1] != "_" else "mlp", name)
    w = np.random.default_rng(1).standard_normal(shapes[name]).astype(np.float32)
    got = quant.quantize(w, "int8")
    want = quant.quantize(plan.transform(path, w), "int8")
    np.testing.assert_array_equal(plan.transform(path, np.asarray(got.q)), np.asarray(want.q))
    np.testing.assert_array_equal(plan.transform_scale(path, np.asarray(got.scale)),
                                  np.asarray(want.scale))


def test_preset_layouts_on_common_sizes():
    smol = PRESETS["smollm2-135m"]
    assert ShardPlan(smol, AbstractMesh((2,), ("tp",))).describe() == (
        "tp=2: 3 KV heads -> 4 (x1 replicas, 1 zero), 9 query heads -> 12 (3 zero), "
        "ffn 1536 -> 1536")
    for t in (2, 4, 8):
        assert plan_heads(PRESETS["llama-3-70b"], t).is_identity(PRESETS["llama-3-70b"])


# -- configuration and the one-device process ----------------------------------------------

@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_bad_tensor_parallel_size_names_the_field(value):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig.build(tensor_parallel_size=value)


def test_too_few_devices_says_how_to_get_more():
    with pytest.raises(ValueError, match="xla_force_host_platform_device_count"):
        make_mesh(len(jax.devices()) + 1)


def test_tp1_engine_keeps_its_single_device_pool():
    from models.servable import random_servable

    engine = LLMEngine(random_servable(_config(4, 2)),
                       EngineConfig.build(max_model_len=32, num_device_pages=4, warmup=False,
                                          show_progress=False))
    assert engine.mesh is None and engine.model.mesh is None
    assert isinstance(engine.kv_pool.sharding, jax.sharding.SingleDeviceSharding)


# -- 4 virtual devices, in a subprocess ----------------------------------------------------

@pytest.fixture(scope="module")
def tp_run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("tp") / "tp.json"
    cmd = [sys.executable, "-m", "tests.superinfer_jax.tp_check", "--devices", "4",
           "--tp", "1,2,4", "--out", str(out)]
    cache = jax.config.jax_compilation_cache_dir
    if cache:
        cmd += ["--cache-dir", cache]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    # Kept beside the result: per-case seconds, and the compiles with JAX_LOG_COMPILES=1.
    out.with_name("tp_check.stderr").write_text(proc.stderr)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("case, tp", [(c, str(t)) for c, t in SHARDED])
def test_greedy_tokens_equal_tp1_with_rotations(tp_run, case, tp):
    runs = tp_run[case]
    assert tp_run["devices"] == 4
    assert runs[tp]["tokens"] == runs["1"]["tokens"]
    assert runs[tp]["rotations"] >= 3 and runs[tp]["pages_in"] > 0
    assert all(len(t) >= 12 for t in runs[tp]["tokens"])


def test_fp8_kv_greedy_tokens_equal_tp1_with_scales_sharded(tp_run):
    runs = tp_run["llama8_fp8"]
    assert runs["2"]["tokens"] == runs["1"]["tokens"]
    assert runs["2"]["rotations"] >= 3 and runs["2"]["pages_in"] > 0
    # [layers, K/V, KV heads]: 8 KV heads, 4 on each device
    assert runs["1"]["kv_scales_shard_shape"] == [2, 2, 8]
    assert runs["2"]["kv_scales_shard_shape"] == [2, 2, 4]
    # calibrated through two layers whose all-reduces sum in another order than TP=1
    tol = f32_tolerance(runs["1"]["kv_scales"], 320, depth=2)
    assert_close(runs["2"]["kv_scales"], runs["1"]["kv_scales"], tol, "TP=2 vs TP=1 scales")


def test_int8_weights_greedy_tokens_equal_tp1_sharded_like_float(tp_run):
    """llama8 with int8 weights, the quantized model converted to TP=2: TP=1's tokens
    with rotations; ``q`` split like the float weight (wq by columns, wo by rows), the
    scales with the output columns (wq's split, wo's whole); converting a quantized model
    gives the arrays that quantizing the sharded float model gives, for int8 and fp8, and
    that a loader placing host-quantized weights (``ParamSink.put_quantized``) gives."""
    runs = tp_run["llama8_int8"]
    assert runs["2"]["tokens"] == runs["1"]["tokens"]
    assert runs["2"]["rotations"] >= 3 and runs["2"]["pages_in"] > 0
    # [hidden 128, 16 heads x 16] and its transpose, each scale [out]; 2 shards
    def placed(wq_q, wq_scale, wo_q, wo_scale):
        return {"wq": {"q": ["int8", wq_q], "scale": ["float32", wq_scale]},
                "wo": {"q": ["int8", wo_q], "scale": ["float32", wo_scale]}}

    assert runs["1"]["placement"] == placed([128, 256], [256], [256, 128], [128])
    assert runs["2"]["placement"] == placed([128, 128], [128], [128, 128], [128])
    assert runs["2"]["same_as_sharded_then_quantized"] == {"int8": True, "fp8": True}
    assert runs["2"]["sink_prequantized_same"]  # GGUF Q8_0's path onto the mesh


def test_fp8_weights_greedy_tokens_equal_tp1(tp_run):
    """llama8 with fp8 e4m3 weights converted to TP=2: TP=1's tokens with rotations, the
    e4m3 ``q`` and the scales split as int8's are."""
    runs = tp_run["llama8_fp8_weights"]
    assert runs["2"]["tokens"] == runs["1"]["tokens"]
    assert runs["2"]["rotations"] >= 3 and runs["2"]["pages_in"] > 0
    assert runs["2"]["placement"]["wq"] == {"q": ["float8_e4m3fn", [128, 128]],
                                            "scale": ["float32", [128]]}
    assert runs["2"]["placement"]["wo"]["q"] == ["float8_e4m3fn", [128, 128]]


@pytest.mark.parametrize("tp", ["2", "4"])
def test_prefix_cache_hits_keep_greedy_tokens(tp_run, tp):
    """llama8 repeats and extends prompts: hits on every TP degree, and the tokens equal
    TP=1's with prefix caching off."""
    runs = tp_run["llama8"]
    assert runs[tp]["cached_tokens"] > 0 and runs["1"]["cached_tokens"] > 0
    assert runs[tp]["tokens"] == runs["1-off"]["tokens"]


@pytest.mark.parametrize("tp", ["2", "4"])
def test_host_tier_prefix_hits_keep_greedy_tokens(tp_run, tp):
    """llama8's second wave, once traffic made the device reclaim every cached page of the
    first: a repeated prompt, a second turn and a shared prefix find their pages in the
    host tier (split over the devices like the pool) and get TP=1's tokens, which are
    caching off's."""
    runs = tp_run["llama8"]
    for run in (runs["1"], runs[tp], runs["1-off"]):
        assert run["wave2_device_pages_before"] == 0  # every hit below is a host hit
        assert all(len(t) == 12 for t in run["wave2_tokens"])
    assert runs[tp]["wave2_tokens"] == runs["1"]["wave2_tokens"] == runs["1-off"]["wave2_tokens"]
    for run in (runs["1"], runs[tp]):
        assert run["wave2_host_hits"] > 0 and run["wave2_prefix_hits_in"] > 0


def test_padding_and_replication_layouts(tp_run):
    """SmolLM2's 3 KV heads padded to 4 at TP=4 (in the engine, and converted); at TP=2
    its layout is checked in-process (``test_preset_layouts_on_common_sizes``)."""
    assert tp_run["smollm2"]["4"]["kv_heads"] == 4  # 3 padded to 4
    assert tp_run["smollm2"]["shard_vs_load"]["kv_heads"] == 4
    assert "1 zero" in tp_run["smollm2"]["4"]["layout"]
    for tp in ("2", "4"):
        assert tp_run["llama8"][tp]["kv_heads"] == 8
    assert "x2 replicas" in tp_run["replicated"]["4"]["layout"]
    assert tp_run["replicated"]["4"]["kv_heads"] == 4


def test_converted_model_equals_the_one_loaded_sharded(tp_run):
    """SmolLM2 converted from the one-device model (``base.shard(make_mesh(4))``) holds
    the same tensors, byte for byte, in the same placements, as SmolLM2 loaded straight
    from GGUF into the sharded layout, whose engine gives TP=1's tokens above: the same
    model, so the same tokens, without compiling its 30-layer step a second time."""
    cmp = tp_run["smollm2"]["shard_vs_load"]
    assert cmp["tp"] == 4 and cmp["tensors"] > 30 * 9  # every layer's tensors, and more
    assert cmp["mismatched"] == []
    assert cmp["configs_equal"] and cmp["layouts"][0] == cmp["layouts"][1]
    assert cmp["layouts"][0] == tp_run["smollm2"]["4"]["layout"]


@pytest.mark.parametrize("case, tp", SHARDED)
def test_pool_and_host_pages_are_split_over_kv_heads(tp_run, case, tp):
    run = tp_run[case][str(tp)]
    pool, shard = run["pool_shape"], run["pool_shard_shape"]
    assert shard == pool[:4] + [pool[4] // tp] + pool[5:]
    host = run["host_pages"]
    assert host["memory_kind"] == "pinned_host" and host["num_shards"] == tp
    assert host["devices"] == list(range(tp))
    assert host["shard_shape"] == shard[1:]  # one page: each device its own heads


@pytest.mark.parametrize("case, tp", SHARDED)
def test_step_has_megatron_collectives_and_never_moves_the_pool(tp_run, case, tp):
    """Two all-reduces per layer (after wo, after w_down), one all-gather of the embedded
    tokens [B, C, hidden], one of the logits [B, vocab], and one of every column's logits
    [B, C, vocab] in the prompt-logprobs branch (run only when a row asks); nothing else,
    and nothing the size of a pool shard (the pool is never gathered)."""
    run = tp_run[case][str(tp)]
    ops = run["step_collectives"]
    reduces = [o for o in ops if o["op"] == "all-reduce"]
    gathers = sorted((o["shape"] for o in ops if o["op"] == "all-gather"), key=len)
    assert len(reduces) == 2 * run["num_layers"]
    assert [len(g) for g in gathers] == [2, 3, 3], gathers
    vocab = gathers[0][-1]
    assert sorted(g[-1] == vocab for g in gathers[1:]) == [False, True]
    assert {o["op"] for o in ops} == {"all-reduce", "all-gather"}
    pool_shard = int(np.prod(run["pool_shard_shape"]))
    assert all(int(np.prod(o["shape"])) < pool_shard for o in ops)


@pytest.mark.parametrize("case, tp", SHARDED)
def test_page_moves_stay_on_each_device(tp_run, case, tp):
    assert tp_run[case][str(tp)]["mover_collectives"] == []


@pytest.mark.parametrize("tp", ["2", "4"])
def test_loader_path_matches_one_device_logits(tp_run, tp):
    """ParamSink with a mesh (padded heads, MLP padded at TP=4, QKV bias, tied lm_head
    re-split from hidden to vocab), with the XLA and the Pallas (interpret) attention."""
    run = tp_run["sink"][tp]
    assert run["tied_exact"] and run["tied_spec"] == "P(None, 'tp')"
    for backend in ("xla", "pallas"):
        # Bound derived in tp_check from the model's shape and logits (tests/numerics).
        got = run[backend]
        assert got["max_abs_diff"] <= got["bound"], (backend, got)
        assert got["top1_disagreements"] == 0 and got["top1_decided"] >= 0.5, (backend, got)
