"""Qwen3, Mixtral and Qwen3-MoE compute what transformers computes (torch CPU, float32),
from every format: safetensors (single file and sharded), GGUF and Orbax.

Tiny random checkpoints (``arch_configs.VARIANTS``) cover GQA, head_dim != hidden /
heads, top-k 1, 2 and 8, norm_topk_prob both ways and dense layers among routed ones.
"""

from __future__ import annotations

import numpy as np
import pytest

from models import LlamaServable, load_model, save_orbax
from models.loaders.hf_config import hf_config
from tests.models import arch_configs
from tests.models.conftest import build_hf_model, save_hf_dir
from tests.models.gguf_writer import write_gguf
from tests.models.test_numerics_hf import hf_greedy, hf_logits, prompt
from tests.numerics import assert_close, assert_same_top1, logits_tolerance

GGUF_VARIANTS = ("qwen3", "mixtral_top2", "qwen3_moe_top2_norm")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_tokenizer, chatml):
    """{variant: (transformers model, HF dir, GGUF path or None)}; the Mixtral top-2
    directory is sharded (model.safetensors.index.json)."""
    out = {}
    for seed, (name, make) in enumerate(arch_configs.VARIANTS.items()):
        model = build_hf_model(make(), seed=10 + seed)
        shard = "60KB" if name == "mixtral_top2" else None
        path = save_hf_dir(model, tmp_path_factory.mktemp(name), tiny_tokenizer,
                           max_shard_size=shard)
        gguf_path = None
        if name in GGUF_VARIANTS:
            gguf_path = tmp_path_factory.mktemp(f"{name}_gguf") / f"{name}.gguf"
            write_gguf(model, tiny_tokenizer, gguf_path, chatml)
        out[name] = (model, path, gguf_path)
    return out


@pytest.fixture(scope="module")
def loaded(checkpoints):
    """variant -> our model from its HF dir, loaded once per module (each load is a new
    set of compiles)."""
    cache: dict[str, LlamaServable] = {}

    def get(variant: str) -> LlamaServable:
        if variant not in cache:
            cache[variant] = load_model(str(checkpoints[variant][1]))
        return cache[variant]
    return get


@pytest.fixture(scope="module", params=list(arch_configs.VARIANTS))
def pair(request, checkpoints, loaded) -> tuple[object, LlamaServable]:
    return checkpoints[request.param][0], loaded(request.param)


def _check_logits(ours: LlamaServable, model, length: int, what: str) -> None:
    # Two float32 implementations summing in different orders (tests/numerics); the
    # routed sum adds top_k terms, far shorter than the reductions the bound takes.
    ids = prompt(length)
    got, ref = ours.logits(ids), hf_logits(model, ids)
    tol = logits_tolerance(ours.config, ref, length)
    assert_close(got, ref, tol, f"{what} logits vs transformers, length {length}")
    assert_same_top1(got, ref, tol, f"{what} top-1 vs transformers, length {length}")


def test_config_is_read_from_config_json(loaded) -> None:
    mixtral = loaded("mixtral_top1").config
    assert mixtral.moe is not None and (mixtral.moe.top_k, mixtral.moe.num_experts) == (1, 4)
    assert mixtral.moe.sparse_layers is None and not mixtral.qk_norm
    qwen3 = loaded("qwen3").config
    assert qwen3.qk_norm and qwen3.moe is None and qwen3.head_dim == 24
    assert qwen3.hidden_size // qwen3.num_heads == 16 and not qwen3.qkv_bias
    moe = loaded("qwen3_moe_top2_norm").config
    assert moe.moe.sparse_layers == (0, 2) and moe.moe.norm_topk_prob  # mlp_only_layers=[1]
    step2 = loaded("qwen3_moe_top8_nonorm").config
    assert step2.moe.sparse_layers == (1,) and not step2.moe.norm_topk_prob  # sparse_step 2
    assert step2.moe.top_k == 8 == step2.moe.num_experts


@pytest.mark.parametrize("length", (1, 33))
def test_logits_match_transformers(pair, length: int) -> None:
    model, ours = pair
    _check_logits(ours, model, length, ours.config.name)


def test_greedy_matches_transformers(pair, greedy) -> None:
    model, ours = pair
    ids = prompt(7, seed=5)
    assert greedy(ours, ids, 32) == hf_greedy(model, ids, 32)


@pytest.mark.parametrize("variant", ["qwen3", "qwen3_moe_top2_norm"])
def test_chunked_prefill_matches_one_shot(loaded, variant: str) -> None:
    ours = loaded(variant)
    ids = prompt(33)
    one_shot = ours.logits(ids)
    chunked = ours.logits(ids, page_size=8, chunk_size=5)
    tol = logits_tolerance(ours.config, one_shot, len(ids))
    assert_close(chunked, one_shot, tol, "chunked vs one-shot logits")


def test_expert_counts_add_up(loaded) -> None:
    """Every valid token is routed to top_k experts of every routed layer; padding
    (a chunk's unused columns) is not counted."""
    assert loaded("qwen3").expert_counts is None
    ours = loaded("qwen3_moe_top2_norm")
    before = ours.expert_counts.snapshot()
    ours.logits(prompt(13), page_size=8, chunk_size=5)  # 3 chunks, the last 2 columns short
    added = ours.expert_counts.snapshot() - before
    assert added.shape == (len(ours.config.moe_layers), ours.config.moe.num_experts)
    assert (added.sum(axis=1) == 13 * ours.config.moe.top_k).all()
    groups = ours.expert_counts.by_group()
    assert sum(int(c.sum()) for c in groups.values()) == int(ours.expert_counts.snapshot().sum())


@pytest.mark.parametrize("variant", GGUF_VARIANTS)
def test_gguf_matches_transformers(checkpoints, loaded, variant: str) -> None:
    model, _, gguf_path = checkpoints[variant]
    ours = load_model(str(gguf_path))
    assert ours.config.moe == loaded(variant).config.moe
    _check_logits(ours, model, 33, f"GGUF {variant}")


def test_fused_expert_tensors_load(checkpoints, tmp_path) -> None:
    """transformers 5's in-memory layout (gate_up_proj, down_proj over all experts)."""
    import shutil

    from safetensors.torch import save_file

    model, path, _ = checkpoints["qwen3_moe_top2_norm"]
    fused = tmp_path / "fused"
    shutil.copytree(path, fused)
    (fused / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(fused / "model.safetensors"))
    assert any(k.endswith("experts.gate_up_proj") for k in model.state_dict())
    _check_logits(load_model(str(fused)), model, 7, "fused experts")


def _same_weights(a: LlamaServable, b: LlamaServable) -> None:
    import jax

    assert jax.tree.structure(a.params) == jax.tree.structure(b.params)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_orbax_and_weights_cache_round_trip(checkpoints, loaded, tmp_path) -> None:
    """Both keep the stacked expert weights bit for bit (the GGUF holds float32 copies
    of the same tensors, so all four models are one)."""
    _, _, gguf_path = checkpoints["mixtral_top2"]
    ours = loaded("mixtral_top2")
    restored = load_model(str(save_orbax(ours, tmp_path / "orbax")))
    assert restored.config == ours.config
    _same_weights(restored, ours)
    first = load_model(str(gguf_path), weights_cache=tmp_path / "cache")
    cached = load_model(str(gguf_path), weights_cache=tmp_path / "cache")
    assert cached.config.moe == ours.config.moe
    assert list((tmp_path / "cache").rglob("params.safetensors"))
    _same_weights(cached, first)
    _same_weights(first, ours)


# --------------------------------------------------------------------------- bad input
def _config_json(checkpoints, variant: str) -> dict:
    import json

    return json.loads((checkpoints[variant][1] / "config.json").read_text())


@pytest.mark.parametrize("variant, change, field", [
    ("mixtral_top2", {"architectures": ["MixtralForSequenceClassification"]}, "architectures"),
    ("mixtral_top2", {"model_type": "deepseek_v3"}, "model_type"),
    ("mixtral_top2", {"sliding_window": 4096}, "sliding_window"),
    ("qwen3", {"use_sliding_window": True}, "use_sliding_window"),
    ("qwen3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}},
     "rope_parameters.rope_type"),
    ("qwen3_moe_top2_norm", {"num_experts_per_tok": 9}, "top_k"),
    ("qwen3_moe_top2_norm", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
])
def test_unsupported_config_names_the_field(checkpoints, variant, change, field) -> None:
    cfg = {**_config_json(checkpoints, variant), **change}
    with pytest.raises(ValueError, match=field):
        hf_config(cfg, name="x")


def test_cli_exits_2_on_unsupported_architecture(checkpoints, tmp_path, capsys) -> None:
    import json
    import shutil

    from serving.cli import main

    bad = tmp_path / "bad"
    shutil.copytree(checkpoints["qwen3"][1], bad)
    cfg = {**_config_json(checkpoints, "qwen3"), "architectures": ["Qwen3ForTokenClassification"]}
    (bad / "config.json").write_text(json.dumps(cfg))
    assert main(["generate", "hi", "--model", str(bad), "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "architectures" in err


def test_gguf_missing_expert_tensor_is_one_line(checkpoints, tmp_path, tiny_tokenizer,
                                                chatml, capsys) -> None:
    from serving.cli import main

    model = checkpoints["mixtral_top2"][0]
    bad = tmp_path / "bad.gguf"
    write_gguf(model, tiny_tokenizer, bad, chatml, skip=("blk.1.ffn_up_exps.weight",))
    with pytest.raises(ValueError, match=r"lacks expert tensor blk\.1\.ffn_up_exps\.weight"):
        load_model(str(bad))
    assert main(["generate", "hi", "--model", str(bad), "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "blk.1.ffn_up_exps.weight" in err


def test_experts_that_do_not_divide_the_mesh(loaded) -> None:
    from jax.sharding import AbstractMesh

    from models.sharding import ShardPlan

    config = loaded("mixtral_top2").config.replace(
        moe=arch_moe(6))
    with pytest.raises(ValueError, match=r"num_experts \(6\).*tensor_parallel_size \(4\)"):
        ShardPlan(config, AbstractMesh((4,), ("tp",)))


def arch_moe(num_experts: int):
    from models.config import MoEConfig

    return MoEConfig(num_experts=num_experts, top_k=2, intermediate_size=96)


@pytest.mark.parametrize("variant", list(arch_configs.VARIANTS))
def test_to_transformers_rebuilds_the_checkpoint(checkpoints, loaded, variant: str) -> None:
    """``models.hf_export`` (the benchmarks' transformers baseline) gives back the
    checkpoint's model: same weights, so the same float32 logits up to torch's own
    rounding (the same kernels on the same shapes)."""
    from models.hf_export import to_transformers

    model = checkpoints[variant][0]
    ids = prompt(7)
    rebuilt = to_transformers(loaded(variant))
    assert type(rebuilt) is type(model)
    np.testing.assert_allclose(hf_logits(rebuilt, ids), hf_logits(model, ids), atol=1e-5,
                               rtol=0)


def test_bfloat16_moe_is_close(checkpoints, loaded) -> None:
    """bfloat16 weights (on CPU: bfloat16 operands, float32 accumulation, also in the
    grouped matmuls): within the bound of ``test_numerics_hf.test_bfloat16_load_is_close``,
    six times the logits' change when every weight is rounded to bfloat16 once."""
    import jax
    import jax.numpy as jnp

    from tests.numerics import max_abs_diff

    model, path, _ = checkpoints["qwen3_moe_top2_norm"]
    ours = load_model(str(path), dtype="bfloat16")
    ids = prompt(33)
    ref = hf_logits(model, ids)
    f32 = load_model(str(path))
    f32.params = jax.tree.map(lambda w: w.astype(jnp.bfloat16).astype(jnp.float32),
                              f32.params)
    weight_rounding = max_abs_diff(f32.logits(ids), ref)
    assert weight_rounding > 0
    assert_close(ours.logits(ids), ref, 6 * weight_rounding, "bfloat16 MoE vs transformers")
