"""Our parameters as a transformers model: the independent reference for numerics and speed.

The numerics tests' oracle and the offline throughput benchmark's baseline (the very
same weights and dtype). Needs the ``dev`` extra (torch, transformers).
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from models.servable import LlamaServable


def _classes(cfg):
    """(config class, model class, extra config fields) of the transformers family."""
    import transformers as tf

    if cfg.moe is not None:
        moe = cfg.moe
        if not cfg.qk_norm and moe.sparse_layers is None and moe.norm_topk_prob:
            return tf.MixtralConfig, tf.MixtralForCausalLM, {
                "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
                "sliding_window": None}
        if not cfg.qk_norm:
            raise ValueError("to_transformers: an MoE config without qk_norm and with dense "
                             "layers or norm_topk_prob off has no transformers family")
        dense = [i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)]
        return tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, {
            "num_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
            "moe_intermediate_size": moe.intermediate_size, "mlp_only_layers": dense,
            "norm_topk_prob": moe.norm_topk_prob, "decoder_sparse_step": 1}
    if cfg.qk_norm:
        return tf.Qwen3Config, tf.Qwen3ForCausalLM, {}
    if cfg.qkv_bias:
        return tf.Qwen2Config, tf.Qwen2ForCausalLM, {}
    return tf.LlamaConfig, tf.LlamaForCausalLM, {}


def to_transformers(servable: LlamaServable, dtype: str | None = None):
    """A transformers CausalLM (Llama, Qwen2, Qwen3, Mixtral or Qwen3-MoE) holding
    exactly our parameters (torch layout)."""
    import torch

    cfg = servable.config
    dtype = dtype or servable.dtype
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    config_cls, model_cls, extra = _classes(cfg)
    hf_cfg = config_cls(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        **extra,
    )
    p = nnx.to_pure_dict(servable.params)

    def t(x, transpose: bool = False):
        x = np.asarray(x, np.float32)
        return torch.from_numpy(np.array(x.T if transpose else x, copy=True)).to(torch_dtype)

    sd = {
        "model.embed_tokens.weight": t(p["embed"]),
        "model.norm.weight": t(p["final_norm"]["weight"]),
    }
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = t(p["lm_head"], transpose=True)
    for i, layer in p["layers"].items():
        pre = f"model.layers.{i}."
        sd[pre + "input_layernorm.weight"] = t(layer["attn_norm"]["weight"])
        sd[pre + "post_attention_layernorm.weight"] = t(layer["mlp_norm"]["weight"])
        for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"),
                             ("wo", "o_proj")):
            sd[pre + f"self_attn.{theirs}.weight"] = t(layer["attn"][ours], transpose=True)
        if cfg.qkv_bias:
            for ours, theirs in (("bq", "q_proj"), ("bk", "k_proj"), ("bv", "v_proj")):
                sd[pre + f"self_attn.{theirs}.bias"] = t(layer["attn"][ours])
        if cfg.qk_norm:
            for name in ("q_norm", "k_norm"):
                sd[pre + f"self_attn.{name}.weight"] = t(layer["attn"][name]["weight"])
        mlp = layer["mlp"]
        if "router" in mlp:  # transformers 5's fused experts: [E, out, in]
            sd[pre + "mlp.gate.weight"] = t(mlp["router"], transpose=True)
            gate_up = np.concatenate([np.asarray(mlp["we_gate"], np.float32),
                                      np.asarray(mlp["we_up"], np.float32)], axis=2)
            sd[pre + "mlp.experts.gate_up_proj"] = t(gate_up.transpose(0, 2, 1))
            down = np.asarray(mlp["we_down"], np.float32).transpose(0, 2, 1)
            sd[pre + "mlp.experts.down_proj"] = t(down)
            continue
        for ours, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"),
                             ("w_down", "down_proj")):
            sd[pre + f"mlp.{theirs}.weight"] = t(mlp[ours], transpose=True)
    torch.manual_seed(0)
    model = model_cls(hf_cfg).to(torch_dtype).eval()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    allowed_missing = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    if unexpected or not set(missing) <= allowed_missing:
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    return model
