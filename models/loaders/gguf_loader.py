"""GGUF (llama.cpp) weights: dequantize, un-permute and transpose into our layout.

Two conventions differ from ours. GGUF stores matrices as torch ``[out, in]`` (its
``tensor.shape`` lists dimensions reversed), and llama.cpp's converter reorders the rows of
Q and K for the "llama" architecture so that its interleaved (GPT-J) RoPE matches the
rotate-half RoPE of the original weights (Mixtral is written as "llama" too). We invert
that row permutation and use rotate-half RoPE, so the loaded weights equal the original
Hugging Face ones. Experts come stacked (``blk.N.ffn_{gate,up,down}_exps``, each expert
``[out, in]``) with the router as ``blk.N.ffn_gate_inp``; a layer is routed when its
router is there.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from jax.sharding import Mesh

import models.quant as quant
from models.config import ModelConfig, MoEConfig
from models.loaders.gguf_q8 import Q8_0, requantize_q8_0
from models.loaders.sink import ParamPath, ParamSink, layer_path
from models.servable import LlamaServable
from models.tokenizer import Tokenizer

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe")
_QK_NORM_ARCHS = ("qwen3", "qwen3moe")
_EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
_SOFTMAX_GATING = 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
_MISSING = object()

_TOP = {
    "token_embd.weight": ("embed",),
    "output_norm.weight": ("final_norm", "weight"),
    "output.weight": ("lm_head",),
}
_LAYER = {
    "attn_norm.weight": ("attn_norm", "weight"),
    "attn_q.weight": ("attn", "wq"),
    "attn_k.weight": ("attn", "wk"),
    "attn_v.weight": ("attn", "wv"),
    "attn_output.weight": ("attn", "wo"),
    "attn_q.bias": ("attn", "bq"),
    "attn_k.bias": ("attn", "bk"),
    "attn_v.bias": ("attn", "bv"),
    "ffn_norm.weight": ("mlp_norm", "weight"),
    "ffn_gate.weight": ("mlp", "w_gate"),
    "ffn_up.weight": ("mlp", "w_up"),
    "ffn_down.weight": ("mlp", "w_down"),
    "attn_q_norm.weight": ("attn", "q_norm", "weight"),
    "attn_k_norm.weight": ("attn", "k_norm", "weight"),
    "ffn_gate_inp.weight": ("mlp", "router"),
    "ffn_gate_exps.weight": ("mlp", "we_gate"),
    "ffn_up_exps.weight": ("mlp", "we_up"),
    "ffn_down_exps.weight": ("mlp", "we_down"),
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def is_gguf_file(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def open_gguf(path: Path) -> gguf.GGUFReader:
    """Open (memory-map) a GGUF file, turning parser failures into a named ValueError."""
    if not is_gguf_file(path):
        raise ValueError(f"{path}: not a GGUF file (missing 'GGUF' magic bytes)")
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as e:
        size = path.stat().st_size
        raise ValueError(f"{path}: corrupt or truncated GGUF file ({size} bytes; "
                         f"{type(e).__name__}: {e})") from e


def _fields(reader: gguf.GGUFReader, path: Path) -> dict[str, Any]:
    """All metadata values as plain Python objects."""
    out = {}
    for key, field in reader.fields.items():
        try:
            out[key] = field.contents()
        except Exception as e:
            raise ValueError(f"{path}: unreadable GGUF metadata {key!r} ({e})") from e
    return out


def _float32_value(value: float) -> float:
    """GGUF stores floats as float32; 9.99999974e-06 reads back as the intended 1e-05."""
    return float(str(np.float32(value)))


def gguf_config(fields: dict[str, Any], tensor_names: set[str], name: str,
                path: Path) -> ModelConfig:
    """ModelConfig from GGUF metadata; fails on features our model would silently ignore."""
    arch = fields.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r} "
                         f"(supported: {', '.join(SUPPORTED_ARCHS)})")

    def get(key: str, default: Any = _MISSING) -> Any:
        value = fields.get(f"{arch}.{key}", default)
        if value is _MISSING:
            raise ValueError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    if "rope_freqs.weight" in tensor_names or get("rope.scaling.type", "none") != "none":
        raise ValueError(f"{path}: GGUF RoPE scaling is not supported; load the Hugging Face "
                         "directory of this model instead")
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    layers = int(get("block_count"))
    moe = _gguf_moe(get, tensor_names, layers, path)
    tokens = fields.get("tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens is not None else int(get("vocab_size"))
    eos = [fields[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
           if k in fields]
    bos = fields.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        name=name,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", get("rope.dimension_count", hidden // heads))),
        rope_theta=_float32_value(get("rope.freq_base", 10000.0)),
        rms_norm_eps=_float32_value(get("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(get("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensor_names,
        qk_norm=arch in _QK_NORM_ARCHS,
        moe=moe,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos)),
    )


def _gguf_moe(get: Callable[..., Any], names: set[str], layers: int,
              path: Path) -> MoEConfig | None:
    """The experts of a GGUF: routed layers are those with a router tensor, each of which
    must hold all three stacked expert weights."""
    sparse = tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in names)
    if not sparse:
        return None
    for i in sparse:
        for t in _EXPERT_TENSORS:
            if f"blk.{i}.{t}.weight" not in names:
                raise ValueError(f"{path}: GGUF lacks expert tensor blk.{i}.{t}.weight "
                                 f"(layer {i} has a router, blk.{i}.ffn_gate_inp.weight)")
    gating = int(get("expert_gating_func", _SOFTMAX_GATING))
    if gating != _SOFTMAX_GATING:
        raise ValueError(f"{path}: unsupported expert_gating_func {gating} (softmax only)")
    experts = int(get("expert_count"))
    ffn = int(get("expert_feed_forward_length", get("feed_forward_length")))
    return MoEConfig(num_experts=experts, top_k=int(get("expert_used_count")),
                     intermediate_size=ffn,
                     norm_topk_prob=bool(get("expert_weights_norm", True)),
                     sparse_layers=None if len(sparse) == layers else sparse)


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's Q/K row permutation (interleaved pairs -> rotate-half halves).

    The converter did ``w.reshape(n_head, 2, hd // 2, ...).swapaxes(1, 2)``; this undoes it
    for a weight ``[out, in]`` or a bias ``[out]``.
    """
    out = w.shape[0]
    half = out // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _target(name: str) -> ParamPath | None:
    if name in _TOP:
        return _TOP[name]
    m = _BLOCK_RE.match(name)
    if m and m.group(2) in _LAYER:
        return layer_path(int(m.group(1)), *_LAYER[m.group(2)])
    return None


def _dequantize(tensor: Any, path: Path) -> np.ndarray:
    """Float32 numpy array in torch layout ([out, in]), owning its memory."""
    shape = tuple(int(d) for d in reversed(tensor.shape))
    try:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        array = np.asarray(array, dtype=np.float32).reshape(shape)
    except Exception as e:
        raise ValueError(
            f"{path}: cannot decode tensor {tensor.name!r} ({tensor.tensor_type.name}, "
            f"shape {shape}): {type(e).__name__}: {e}"
        ) from e
    return array if array.flags.owndata else array.copy()


def _to_model_layout(name: str, w: np.ndarray, config: ModelConfig,
                     permuted: bool) -> np.ndarray:
    """Torch layout -> ours: un-permute Q/K, transpose matrices to [in, out] (each
    expert's, for the stacked [experts, out, in] ones)."""
    if w.ndim == 3:
        return np.ascontiguousarray(w.transpose(0, 2, 1))
    if permuted and (".attn_q." in name or ".attn_k." in name):
        n_head = config.num_heads if ".attn_q." in name else config.num_kv_heads
        w = unpermute_rows(w, n_head)
    return np.ascontiguousarray(w.T) if w.ndim == 2 and name != "token_embd.weight" else w


# Block formats whose projections quantize to ``model.quantization`` int8 / fp8: each
# tensor is requantized per output channel as it arrives, Q8_0 straight from its int8
# blocks (``gguf_q8``), the others decoded to float first (Q4_0 / Q4_1's 4-bit blocks fit
# one int8 or e4m3 channel scale within the tolerance docs/quantization.md measures).
# The k-quants and i-quants keep nested super-block scales this loader does not map.
QUANTIZABLE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")


def check_quantizable(reader: gguf.GGUFReader, path: Path, quantization: str) -> None:
    """A one-line ``ValueError`` naming ``model.quantization`` and the first projection
    tensor whose block format does not map to ``quantization``."""
    if quantization == "none":
        return
    for tensor in reader.tensors:
        target = _target(tensor.name)
        if target is None or target == ("embed",) or target[-1] == "weight":
            continue  # the embedding stays float; norms are vectors
        kind = tensor.tensor_type.name
        if kind not in QUANTIZABLE_TYPES:
            raise ValueError(
                f"model.quantization: {quantization} cannot map GGUF tensor {tensor.name!r} "
                f"of {path.name} (block type {kind}; mappable: {', '.join(QUANTIZABLE_TYPES)}"
                "); set model.quantization to none or use a Q8_0 / Q4_0 / Q4_1 file")


def _from_blocks(tensor: Any, target: ParamPath, quantization: str) -> bool:
    """Whether a projection is quantized straight from its Q8_0 blocks (``gguf_q8``)
    rather than dequantized to float and quantized (always so for ``w8a8_int8``, whose
    weights are rotated before they round, ``models.quant``)."""
    return quantization not in ("none", quant.W8A8) and tensor.tensor_type == Q8_0 and \
        quant.quantized_path(target, np.empty((0,) * len(tensor.shape)))


def load_gguf(path: str | Path, dtype: str = "float32", name: str | None = None,
              progress: Callable[[str], None] | None = None,
              mesh: Mesh | None = None, quantization: str = "none") -> LlamaServable:
    """Load a GGUF file (any quantization gguf-py can dequantize) into a servable,
    tensor-parallel over ``mesh`` when given, its projections quantized tensor by tensor
    to ``quantization`` (``check_quantizable``): Q8_0 ones straight from their int8 blocks
    (``gguf_q8``), the others dequantized first."""
    path = Path(path)
    reader = open_gguf(path)
    check_quantizable(reader, path, quantization)
    fields = _fields(reader, path)
    names = {t.name for t in reader.tensors}
    config = gguf_config(fields, names, name or path.stem, path)
    try:
        tokenizer = Tokenizer.from_gguf_fields(fields)
    except (KeyError, ValueError) as e:
        raise ValueError(f"{path}: cannot build tokenizer ({e})") from e
    permuted = fields["general.architecture"] == "llama"
    sink = ParamSink(config, dtype, mesh, quantization)
    for tensor in reader.tensors:
        target = _target(tensor.name)
        if target is None:
            continue  # e.g. rope_freqs handled above; nothing else is needed
        source = f"{path}: tensor {tensor.name!r}"
        if _from_blocks(tensor, target, quantization):
            values, scales = requantize_q8_0(tensor, quantization)
            values = _to_model_layout(tensor.name, values, config, permuted)
            if scales.ndim == 1:  # [out]: Q and K rows un-permuted like the values'
                scales = _to_model_layout(tensor.name, scales, config, permuted)
            sink.put_quantized(target, values, scales, source)
            del values
        else:
            w = _to_model_layout(tensor.name, _dequantize(tensor, path), config, permuted)
            sink.put(target, w, source)
            del w
        if progress:
            progress(tensor.name)
    if config.tie_word_embeddings and sink.has(("embed",)):
        sink.tie_lm_head()
    del reader
    return sink.servable(str(path), tokenizer)
