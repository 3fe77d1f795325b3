"""Hugging Face checkpoints: config.json + one or many safetensors files.

Tensors are read one at a time with ``safe_open(framework="flax")``: the numpy framework
cannot represent bfloat16, which most Llama checkpoints use, while the flax one returns
jax arrays of any dtype. Each tensor is transposed to ``[in, out]`` and cast as it goes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from jax.sharding import Mesh
from safetensors import safe_open

from models.config import ModelConfig, RopeScaling
from models.loaders.sink import ParamPath, ParamSink, layer_path
from models.servable import LlamaServable
from models.tokenizer import Tokenizer

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
INDEX_FILE = "model.safetensors.index.json"

# HF name suffix -> (our path inside a layer, needs transpose)
_LAYER: dict[str, tuple[tuple[str, ...], bool]] = {
    "input_layernorm.weight": (("attn_norm", "weight"), False),
    "self_attn.q_proj.weight": (("attn", "wq"), True),
    "self_attn.k_proj.weight": (("attn", "wk"), True),
    "self_attn.v_proj.weight": (("attn", "wv"), True),
    "self_attn.o_proj.weight": (("attn", "wo"), True),
    "self_attn.q_proj.bias": (("attn", "bq"), False),
    "self_attn.k_proj.bias": (("attn", "bk"), False),
    "self_attn.v_proj.bias": (("attn", "bv"), False),
    "post_attention_layernorm.weight": (("mlp_norm", "weight"), False),
    "mlp.gate_proj.weight": (("mlp", "w_gate"), True),
    "mlp.up_proj.weight": (("mlp", "w_up"), True),
    "mlp.down_proj.weight": (("mlp", "w_down"), True),
}
_TOP: dict[str, tuple[ParamPath, bool]] = {
    "embed_tokens.weight": (("embed",), False),
    "norm.weight": (("final_norm", "weight"), False),
    "lm_head.weight": (("lm_head",), True),
}
_LAYER_RE = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _read_config(path: Path) -> dict[str, Any]:
    file = path / "config.json"
    if not file.is_file():
        raise ValueError(f"{path}: missing config.json")
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: invalid JSON ({e})") from e


def _rope(cfg: Mapping[str, Any], where: str) -> tuple[float, RopeScaling | None]:
    """rope_theta and llama3 scaling from either config layout.

    transformers < 5 writes top-level ``rope_theta`` and ``rope_scaling``; transformers 5
    writes one ``rope_parameters`` dict holding the theta, the type and the factors.
    """
    params = cfg.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    if kind != "llama3":
        raise ValueError(f"{where}: unsupported rope scaling type {kind!r} (supported: llama3)")
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
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{where}: unsupported model_type {model_type!r} "
                         f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: unsupported hidden_act {cfg['hidden_act']!r}")
    if cfg.get("mlp_bias") or (model_type != "qwen2" and cfg.get("attention_bias")):
        raise ValueError(f"{where}: attention/MLP output biases are not supported")
    if cfg.get("use_sliding_window") or (model_type == "mistral" and cfg.get("sliding_window")):
        raise ValueError(f"{where}: sliding-window attention is not supported")
    return model_type


def hf_config(cfg: Mapping[str, Any], name: str, where: str = "config.json") -> ModelConfig:
    """ModelConfig from a Hugging Face config.json dict (llama, qwen2, mistral)."""
    model_type = _check_supported(cfg, where)
    try:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        theta, scaling = _rope(cfg, where)
        return ModelConfig(
            name=name,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_ids(cfg.get("eos_token_id")),
        )
    except KeyError as e:
        raise ValueError(f"{where}: missing required field {e.args[0]!r}") from e


def safetensors_files(path: Path) -> list[Path]:
    """The weight files: those the index names if there is one, else every *.safetensors."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as e:
            raise ValueError(f"{index}: invalid safetensors index ({e})") from e
        files = [path / f for f in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index}: lists missing shard files: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors weight files (.bin is not supported)")
    return files


def _target(name: str) -> tuple[ParamPath, bool] | None:
    m = _LAYER_RE.match(name)
    if m:
        layer, suffix = int(m.group(1)), m.group(2)
        if suffix in _LAYER:
            sub, transpose = _LAYER[suffix]
            return layer_path(layer, *sub), transpose
        return None
    return _TOP.get(name.removeprefix("model."))


def iter_tensors(file: Path) -> Iterator[tuple[str, Any]]:
    """(name, jax array) pairs of one safetensors file, read lazily one tensor at a time."""
    try:
        with safe_open(str(file), framework="flax") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
    except Exception as e:
        raise ValueError(f"{file}: corrupt or truncated safetensors file "
                         f"({type(e).__name__}: {e})") from e


def _fill(sink: ParamSink, files: list[Path]) -> None:
    for file in files:
        for name, tensor in iter_tensors(file):
            target = _target(name)
            if target is None:
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                raise ValueError(f"{file}: unsupported tensor {name!r}")
            path, transpose = target
            sink.put(path, tensor.T if transpose else tensor, f"{file}: tensor {name!r}")
            del tensor


def load_hf_dir(path: str | Path, dtype: str = "float32",
                mesh: Mesh | None = None) -> LlamaServable:
    """Load a Llama/Qwen2 Hugging Face directory (config.json, safetensors, tokenizer.json),
    tensor-parallel over ``mesh`` when given."""
    path = Path(path)
    raw = _read_config(path)
    config = hf_config(raw, name=path.resolve().name, where=str(path / "config.json"))
    files = safetensors_files(path)
    tokenizer = Tokenizer.from_hf_dir(path, raw)
    config = config.replace(eos_token_ids=tokenizer.eos_token_ids or config.eos_token_ids,
                            bos_token_id=tokenizer.bos_token_id)
    sink = ParamSink(config, dtype, mesh)
    _fill(sink, files)
    if not sink.has(("lm_head",)) and sink.has(("embed",)):
        if not config.tie_word_embeddings:
            raise ValueError(f"{path}: no lm_head.weight and tie_word_embeddings is false")
        sink.tie_lm_head()
    return sink.servable(str(path), tokenizer)
