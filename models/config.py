"""Architecture configuration for the decoders we serve: the Llama family (Llama-2/3,
SmolLM2, Qwen2), Qwen3, and the mixture-of-experts Mixtral and Qwen3-MoE.

One frozen dataclass describes every member: the differences between families are a
handful of switches (QKV bias, per-head q/k norms, tied embeddings, rope scaling) and an
optional ``MoEConfig`` that turns some or all MLPs into routed experts, not separate code
paths.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling ("rope_type": "llama3")."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            if not getattr(self, name) > 0:
                raise ValueError(f"rope_scaling.{name} must be > 0, got {getattr(self, name)}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("rope_scaling.high_freq_factor must exceed low_freq_factor")


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts: each token's ``top_k`` experts of ``num_experts`` SwiGLU MLPs.

    Routing is a softmax over all router logits, the top ``top_k`` kept and, with
    ``norm_topk_prob``, renormalised to sum to 1 (Mixtral always; for top-k that equals
    a softmax over the selected logits). ``sparse_layers``: the layers whose MLP is
    routed (None: every layer); the others keep the dense MLP of ``intermediate_size``.
    """

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    norm_topk_prob: bool = True
    sparse_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"moe config field {name} must be a positive int, "
                                 f"got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"moe top_k ({self.top_k}) exceeds num_experts "
                             f"({self.num_experts})")

    def is_sparse(self, layer: int) -> bool:
        return self.sparse_layers is None or layer in self.sparse_layers


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and switches of a Llama-family decoder."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k, before RoPE
    moe: MoEConfig | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model config field {name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.moe is not None and self.moe.sparse_layers is not None:
            bad = [i for i in self.moe.sparse_layers if not 0 <= i < self.num_layers]
            if bad:
                raise ValueError(f"moe sparse_layers {bad} outside the {self.num_layers} "
                                 "layers")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is routed experts."""
        return self.moe is not None and self.moe.is_sparse(layer)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (the metadata of Orbax checkpoints and converted weights)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """The inverse of ``to_dict`` (nested ``rope_scaling`` and the EOS tuple rebuilt)."""
        data = dict(data)
        if data.get("rope_scaling") is not None:
            data["rope_scaling"] = RopeScaling(**data["rope_scaling"])
        data["eos_token_ids"] = tuple(data.get("eos_token_ids", ()))
        if data.get("moe") is not None:
            moe = dict(data["moe"])
            if moe.get("sparse_layers") is not None:
                moe["sparse_layers"] = tuple(moe["sparse_layers"])
            data["moe"] = MoEConfig(**moe)
        return cls(**data)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies [head_dim // 2], with Llama-3 scaling applied."""
        exponents = np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim
        inv_freq = 1.0 / (self.rope_theta**exponents)
        if self.rope_scaling is None:
            return inv_freq.astype(np.float32)
        s = self.rope_scaling
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor
        )
        scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        blended = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
        return np.where(medium, blended, scaled).astype(np.float32)

    def num_params(self, active: bool = False) -> int:
        """Parameters in total, or with ``active`` those one token computes with (its
        ``top_k`` experts of each routed layer, and the router)."""
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = d * self.num_heads * self.head_dim
        kv = 2 * d * self.num_kv_heads * self.head_dim
        o = self.num_heads * self.head_dim * d
        norms = 2 * d + (2 * self.head_dim if self.qk_norm else 0)
        total = 0
        for layer in range(self.num_layers):
            mlp = 3 * d * f
            if self.moe is not None and self.is_moe_layer(layer):
                experts = self.moe.top_k if active else self.moe.num_experts
                mlp = experts * 3 * d * self.moe.intermediate_size + d * self.moe.num_experts
            total += q + kv + o + mlp + norms
        head = 0 if self.tie_word_embeddings else v * d
        return total + v * d + head + d


_LLAMA_3_8B = ModelConfig(
    name="llama-3-8b",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=500000.0,
    rope_scaling=RopeScaling(),
    max_position_embeddings=131072,
    bos_token_id=128000,
    eos_token_ids=(128001, 128008, 128009),
)

PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        name="smollm2-135m",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
    ),
    "llama-3-8b": _LLAMA_3_8B,
    # The 8B's tokenizer, RoPE, KV heads and head dim: derived, so the two cannot drift.
    "llama-3-70b": _LLAMA_3_8B.replace(
        name="llama-3-70b",
        hidden_size=8192,
        intermediate_size=28672,
        num_layers=80,
        num_heads=64,
    ),
    "qwen2.5-32b": ModelConfig(
        name="qwen2.5-32b",
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=27648,
        num_layers=64,
        num_heads=40,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        qkv_bias=True,
        eos_token_ids=(151645, 151643),
    ),
}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        known = ", ".join(sorted(PRESETS))
        raise ValueError(f"unknown model preset {name!r}; known presets: {known}") from None
