"""``ModelConfig`` from a Hugging Face ``config.json``: which architectures we serve and
how their fields map, refusing any field value the model would otherwise ignore (a
sliding window, an unknown RoPE type, biases we do not implement)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from models.config import ModelConfig, MoEConfig, RopeScaling

# model_type -> the ``architectures`` entry its checkpoints name
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)


def _rope(cfg: Mapping[str, Any], where: str) -> tuple[float, RopeScaling | None]:
    """rope_theta and llama3 scaling from either config layout.

    transformers < 5 writes top-level ``rope_theta`` and ``rope_scaling``; transformers 5
    writes one ``rope_parameters`` dict holding the theta, the type and the factors.
    """
    params = cfg.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    field = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    scaling = cfg.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    if kind != "llama3":
        raise ValueError(f"{where}: unsupported {field}.rope_type {kind!r} "
                         "(supported: default, llama3)")
    return theta, RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list | tuple) else (int(value),)


def _check_supported(cfg: Mapping[str, Any], where: str) -> str:
    """Reject features the model does not implement instead of loading them wrongly."""
    model_type = cfg.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"{where}: unsupported model_type {model_type!r} "
                         f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    archs = cfg.get("architectures") or [ARCHITECTURES[model_type]]
    if ARCHITECTURES[model_type] not in archs:
        raise ValueError(f"{where}: unsupported architectures {archs!r} for model_type "
                         f"{model_type!r} (supported: {ARCHITECTURES[model_type]})")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: unsupported hidden_act {cfg['hidden_act']!r}")
    if cfg.get("mlp_bias") or (model_type != "qwen2" and cfg.get("attention_bias")):
        raise ValueError(f"{where}: attention_bias/mlp_bias (output biases) are not "
                         "supported")
    if cfg.get("use_sliding_window"):
        raise ValueError(f"{where}: use_sliding_window is true; sliding-window attention "
                         "is not supported")
    if model_type in ("mistral", "mixtral") and cfg.get("sliding_window"):
        raise ValueError(f"{where}: sliding_window is {cfg['sliding_window']!r}; "
                         "sliding-window attention is not supported")
    return model_type


def _moe(cfg: Mapping[str, Any], model_type: str, num_layers: int) -> MoEConfig | None:
    if model_type == "mixtral":
        return MoEConfig(num_experts=int(cfg["num_local_experts"]),
                         top_k=int(cfg["num_experts_per_tok"]),
                         intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=True)
    if model_type != "qwen3_moe":
        return None
    experts = int(cfg.get("num_experts") or cfg["num_local_experts"])
    step = int(cfg.get("decoder_sparse_step", 1))
    if step < 1:
        raise ValueError(f"decoder_sparse_step must be >= 1, got {step}")
    dense = set(cfg.get("mlp_only_layers") or ())
    sparse = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    return MoEConfig(num_experts=experts, top_k=int(cfg["num_experts_per_tok"]),
                     intermediate_size=int(cfg["moe_intermediate_size"]),
                     norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                     sparse_layers=None if len(sparse) == num_layers else sparse)


def hf_config(cfg: Mapping[str, Any], name: str, where: str = "config.json") -> ModelConfig:
    """ModelConfig from a Hugging Face config.json dict (``ARCHITECTURES``)."""
    model_type = _check_supported(cfg, where)
    try:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        layers = int(cfg["num_hidden_layers"])
        theta, scaling = _rope(cfg, where)
        return ModelConfig(
            name=name,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            moe=_moe(cfg, model_type, layers),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_ids(cfg.get("eos_token_id")),
        )
    except KeyError as e:
        raise ValueError(f"{where}: missing required field {e.args[0]!r}") from e
    except ValueError as e:
        if str(e).startswith(where):
            raise
        raise ValueError(f"{where}: {e}") from e
