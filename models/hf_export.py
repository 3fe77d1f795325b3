"""Our parameters as a transformers model: the independent reference for numerics and speed.

The numerics tests' oracle and the offline throughput benchmark's baseline (the very
same weights and dtype). Needs the ``dev`` extra (torch, transformers).
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from models.servable import LlamaServable


def to_transformers(servable: LlamaServable, dtype: str | None = None):
    """A transformers Llama/Qwen2 CausalLM holding exactly our parameters (torch layout)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cfg = servable.config
    dtype = dtype or servable.dtype
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    config_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if cfg.qkv_bias else (
        LlamaConfig, LlamaForCausalLM)
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
        for ours, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"),
                             ("w_down", "down_proj")):
            sd[pre + f"mlp.{theirs}.weight"] = t(layer["mlp"][ours], transpose=True)
    torch.manual_seed(0)
    model = model_cls(hf_cfg).to(torch_dtype).eval()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    allowed_missing = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    if unexpected or not set(missing) <= allowed_missing:
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    return model
