"""Hugging Face checkpoints: config.json + one or many safetensors files.

MoE checkpoints store one tensor per expert; they are stacked here into the model's
``[experts, in, out]`` weights (``models.moe``).

Tensors are read one at a time with ``safe_open(framework="flax")``: the numpy framework
cannot represent bfloat16, which most Llama checkpoints use, while the flax one returns
jax arrays of any dtype. Each tensor is transposed to ``[in, out]`` and cast as it goes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax.numpy as jnp
from jax.sharding import Mesh
from safetensors import safe_open

from models.config import ModelConfig
from models.loaders.hf_config import SUPPORTED_MODEL_TYPES, hf_config
from models.loaders.sink import ParamPath, ParamSink, layer_path
from models.servable import LlamaServable
from models.tokenizer import Tokenizer

__all__ = ["SUPPORTED_MODEL_TYPES", "hf_config", "load_hf_dir", "safetensors_files"]
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
    "self_attn.q_norm.weight": (("attn", "q_norm", "weight"), False),
    "self_attn.k_norm.weight": (("attn", "k_norm", "weight"), False),
    "mlp.gate.weight": (("mlp", "router"), True),  # Qwen3-MoE
    "block_sparse_moe.gate.weight": (("mlp", "router"), True),  # Mixtral
}
# One expert's matrix (torch [out, in]) -> its slot of a stacked [experts, in, out] weight.
_EXPERT_RE = re.compile(r"^(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight$")
_FUSED_RE = re.compile(r"^(?:block_sparse_moe|mlp)\.experts\.(gate_up_proj|down_proj)$")
_EXPERT = {"w1": "we_gate", "w3": "we_up", "w2": "we_down",  # Mixtral
           "gate_proj": "we_gate", "up_proj": "we_up", "down_proj": "we_down"}  # Qwen3-MoE
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


class _ExpertStacker:
    """Per-expert tensors gathered into the stacked ``[experts, in, out]`` weights; each
    stacked weight goes to the sink when its last expert arrives."""

    def __init__(self, sink: ParamSink, num_experts: int):
        self.sink, self.num_experts = sink, num_experts
        self.pending: dict[ParamPath, dict[int, Any]] = {}

    def put(self, name: str, tensor: Any, source: str) -> bool:
        """Take ``name`` if it is one expert's matrix, or all experts' fused ones
        (transformers 5's in-memory layout); whether it was."""
        m = _LAYER_RE.match(name)
        fused = _FUSED_RE.match(m.group(2)) if m else None
        if m is not None and fused is not None:
            self._put_fused(int(m.group(1)), fused.group(1), tensor, source)
            return True
        e = _EXPERT_RE.match(m.group(2)) if m else None
        if m is None or e is None or e.group(2) not in _EXPERT:
            return False
        expert = int(e.group(1))
        if expert >= self.num_experts:
            raise ValueError(f"{source}: expert {expert} beyond num_experts "
                             f"{self.num_experts}")
        path = layer_path(int(m.group(1)), "mlp", _EXPERT[e.group(2)])
        slots = self.pending.setdefault(path, {})
        slots[expert] = tensor.T
        if len(slots) == self.num_experts:
            self.sink.put(path, jnp.stack([slots[i] for i in range(self.num_experts)]),
                          source)
            del self.pending[path]
        return True

    def _put_fused(self, layer: int, kind: str, tensor: Any, source: str) -> None:
        """gate_up_proj [experts, 2 * ffn, hidden] (gate first), down_proj [experts,
        hidden, ffn]: each expert transposed to [in, out]."""
        if kind == "down_proj":
            self.sink.put(layer_path(layer, "mlp", "we_down"), tensor.transpose(0, 2, 1),
                          source)
            return
        gate, up = jnp.split(tensor.transpose(0, 2, 1), 2, axis=2)
        self.sink.put(layer_path(layer, "mlp", "we_gate"), gate, source)
        self.sink.put(layer_path(layer, "mlp", "we_up"), up, source)

    def check_complete(self, where: str) -> None:
        for path, slots in self.pending.items():
            missing = sorted(set(range(self.num_experts)) - set(slots))
            raise ValueError(f"{where}: {'.'.join(map(str, path))} lacks experts {missing}")


def iter_tensors(file: Path) -> Iterator[tuple[str, Any]]:
    """(name, jax array) pairs of one safetensors file, read lazily one tensor at a time."""
    try:
        with safe_open(str(file), framework="flax") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
    except Exception as e:
        raise ValueError(f"{file}: corrupt or truncated safetensors file "
                         f"({type(e).__name__}: {e})") from e


def _fill(sink: ParamSink, files: list[Path], config: ModelConfig) -> None:
    experts = _ExpertStacker(sink, config.moe.num_experts if config.moe else 0)
    for file in files:
        for name, tensor in iter_tensors(file):
            source = f"{file}: tensor {name!r}"
            target = _target(name)
            if target is None:
                if name.endswith(_IGNORED_SUFFIXES) or experts.put(name, tensor, source):
                    continue
                raise ValueError(f"{file}: unsupported tensor {name!r}")
            path, transpose = target
            sink.put(path, tensor.T if transpose else tensor, source)
            del tensor
    experts.check_complete(str(files[0].parent))


def load_hf_dir(path: str | Path, dtype: str = "float32",
                mesh: Mesh | None = None) -> LlamaServable:
    """Load a Hugging Face directory (config.json of an architecture ``hf_config``
    supports, safetensors, tokenizer.json), tensor-parallel over ``mesh`` when given."""
    path = Path(path)
    raw = _read_config(path)
    config = hf_config(raw, name=path.resolve().name, where=str(path / "config.json"))
    files = safetensors_files(path)
    tokenizer = Tokenizer.from_hf_dir(path, raw)
    config = config.replace(eos_token_ids=tokenizer.eos_token_ids or config.eos_token_ids,
                            bos_token_id=tokenizer.bos_token_id)
    sink = ParamSink(config, dtype, mesh)
    _fill(sink, files, config)
    if not sink.has(("lm_head",)) and sink.has(("embed",)):
        if not config.tie_word_embeddings:
            raise ValueError(f"{path}: no lm_head.weight and tie_word_embeddings is false")
        sink.tie_lm_head()
    return sink.servable(str(path), tokenizer)
