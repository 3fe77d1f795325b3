"""Megatron-style tensor parallelism, and expert parallelism for MoE layers: the head
layout and the partition rules.

Weights are split so that each transformer block needs one all-reduce after attention
and one after the MLP, and nothing else:

    wq, wk, wv   [hidden, heads * head_dim]   columns split (whole heads per shard)
    bq, bk, bv   [heads * head_dim]           split the same way
    wo           [heads * head_dim, hidden]   rows split -> partial sums -> all-reduce
    w_gate, w_up [hidden, ffn]                columns split
    w_down       [ffn, hidden]                rows split -> partial sums -> all-reduce
    embed        [vocab, hidden]              hidden split (the lookup stays local; the
                                              [B, C, hidden] result is all-gathered once)
    lm_head      [hidden, vocab]              vocab split; logits [B, vocab] all-gathered
                                              once so sampling sees the whole vocabulary
    norms                                     replicated
    quantized weights (``models.quant``)      ``q`` split like the float weight, the
                                              per-output-channel scales like its output
                                              axis (``scale_spec``)
    we_gate, we_up, we_down [experts, ...]    expert axis split: whole experts per device
                                              (expert parallelism, ``models.moe``); the
                                              router is replicated, the layer's output
                                              partial sums psum-ed

Heads that do not divide the mesh. Every shard needs whole KV heads (the pool is split
over them) with their query groups. With ``K`` KV heads, ``G`` query heads per KV head
and ``T`` shards, the layout chooses ``r`` replicas of each KV head and ``pad`` zero KV
heads with ``K' = K * r + pad`` a multiple of ``T``, each group split into ``r`` parts of
``G' = ceil(G / r)`` query heads (zero heads fill a short part); the smallest ``K'``
(KV memory is the scarce resource), then the fewest query heads:

    SmolLM2   K=3, G=3, T=2 or 4:  r=1, pad=1  -> K'=4, 12 query heads (3 of them zero)
    Llama-3   K=8, G=4, T<=8:      unchanged
    Llama-3   K=8, G=4, T=16:      r=2        -> K'=16, G'=2 (each KV head on 2 shards)
    tiny      K=2, G=3, T=4:       r=2        -> K'=4, G'=2 (one zero query head per KV head)

A zero query head has zero ``wq`` columns and ``wo`` rows, so the output is unchanged; a
zero KV head has zero ``wk``/``wv`` columns and only zero query heads read it. A
replicated KV head caches the same K/V on each of its shards (``K' / K`` times the KV
memory, over ``T`` devices). The MLP's hidden size is zero-padded the same way.

Everything here is host-side and per tensor, so loaders transform and place each tensor
as it is read and the full model never sits on one device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.config import ModelConfig
from superinfer_jax.dist.parallel import TP_AXIS

ParamPath = tuple[str | int, ...]

_COLUMNS = P(None, TP_AXIS)  # [in, out]: out split
_ROWS = P(TP_AXIS, None)  # [in, out]: in split
_VECTOR = P(TP_AXIS)
EXPERT_SPEC = P(TP_AXIS, None, None)  # stacked expert weights: whole experts per device


def scale_spec(spec: P, ndim: int) -> P:
    """Where the per-output-channel scales ``[..., out]`` of a quantized weight ``[..., in,
    out]`` with ``spec`` go (``models.quant``): the weight's spec without its contraction
    axis, so each shard holds the scales of its own columns (and of its own experts), and
    a row-split weight's scales are replicated."""
    axes = tuple(spec) + (None,) * (ndim - len(spec))
    return P(*axes[:-2], axes[-1])


EXPERT_SCALE_SPEC = scale_spec(EXPERT_SPEC, 3)  # [experts, out]: with their experts
_RULES: dict[str, P] = {
    "wq": _COLUMNS, "wk": _COLUMNS, "wv": _COLUMNS, "bq": _VECTOR, "bk": _VECTOR,
    "bv": _VECTOR, "wo": _ROWS, "w_gate": _COLUMNS, "w_up": _COLUMNS, "w_down": _ROWS,
    "we_gate": EXPERT_SPEC, "we_up": EXPERT_SPEC, "we_down": EXPERT_SPEC,
}
_QUERY = ("wq", "bq", "wo")  # tensors indexed by query head
_KEY_VALUE = ("wk", "wv", "bk", "bv")  # tensors indexed by KV head


@dataclass(frozen=True)
class HeadLayout:
    """Where each head of the sharded model comes from (-1: an all-zero head)."""

    tensor_parallel_size: int
    kv_replicas: int  # r: copies of each original KV head
    q_source: tuple[int, ...]  # [heads'] original query head of each new one
    kv_source: tuple[int, ...]  # [kv_heads'] original KV head of each new one
    intermediate_size: int  # MLP hidden size, padded to a multiple of the mesh size

    @property
    def num_heads(self) -> int:
        return len(self.q_source)

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_source)

    def is_identity(self, config: ModelConfig) -> bool:
        return (self.q_source == tuple(range(config.num_heads))
                and self.kv_source == tuple(range(config.num_kv_heads))
                and self.intermediate_size == config.intermediate_size)


def plan_heads(config: ModelConfig, tensor_parallel_size: int) -> HeadLayout:
    """The head layout for ``tensor_parallel_size`` shards (see the module docstring)."""
    t, k, g = tensor_parallel_size, config.num_kv_heads, config.num_queries_per_kv

    def cost(r: int) -> tuple[int, int, int]:
        kv = k * r + (-k * r) % t
        return kv, kv * math.ceil(g / r), r

    r = min(range(1, t + 1), key=cost)
    num_kv, group = cost(r)[0], math.ceil(g / r)
    kv_source = [j // r if j < k * r else -1 for j in range(num_kv)]
    q_source = []
    for j in range(num_kv):
        for s in range(group):
            orig = (j % r) * group + s  # position inside the original group
            q_source.append(kv_source[j] * g + orig if kv_source[j] >= 0 and orig < g else -1)
    ffn = config.intermediate_size
    return HeadLayout(t, r, tuple(q_source), tuple(kv_source), ffn + (-ffn) % t)


def sharded_config(config: ModelConfig, layout: HeadLayout) -> ModelConfig:
    """The config the sharded module is built with (padded head and MLP sizes)."""
    return config.replace(num_heads=layout.num_heads, num_kv_heads=layout.num_kv_heads,
                          intermediate_size=layout.intermediate_size)


def _take(w: Any, source: np.ndarray, axis: int, fill: float = 0) -> Any:
    """``w`` indexed along ``axis`` by ``source``, ``fill`` where ``source`` is -1."""
    xp = np if isinstance(w, np.ndarray) else jnp
    taken = xp.take(w, np.maximum(source, 0), axis=axis)
    shape = [1] * w.ndim
    shape[axis] = source.size
    return xp.where((source >= 0).reshape(shape), taken, xp.full((), fill, w.dtype))


def _head_index(source: tuple[int, ...], head_dim: int) -> np.ndarray:
    """Per-element source index of a ``[heads * head_dim]`` axis (-1 for zero heads)."""
    src = np.asarray(source)[:, None]
    return np.where(src >= 0, src * head_dim + np.arange(head_dim), -1).reshape(-1)


class ShardPlan:
    """How one model is laid out on one mesh: the head layout, shardings and transforms."""

    def __init__(self, config: ModelConfig, mesh: Mesh | AbstractMesh):
        """``mesh``: where the weights go; an ``AbstractMesh`` is enough for the layout
        and ``transform`` alone (no device is touched)."""
        self.config = config
        self.mesh = mesh
        if config.moe is not None and config.moe.num_experts % mesh.size:
            raise ValueError(
                f"num_experts ({config.moe.num_experts}) is not a multiple of "
                f"tensor_parallel_size ({mesh.size}): expert parallelism puts whole experts "
                "on each device")
        self.layout = plan_heads(config, mesh.size)
        self.module_config = sharded_config(config, self.layout)
        d = config.head_dim
        self._index = {"q": _head_index(self.layout.q_source, d),
                       "kv": _head_index(self.layout.kv_source, d)}
        ffn = np.arange(self.layout.intermediate_size)
        self._index["ffn"] = np.where(ffn < config.intermediate_size, ffn, -1)
        self._reshard_fns: dict[tuple[Any, ...], Any] = {}

    def spec(self, path: ParamPath) -> P:
        name = path[-1]
        if name in _RULES:
            return _RULES[name]
        if path == ("embed",) and self.config.hidden_size % self.mesh.size == 0:
            return P(None, TP_AXIS)
        if path == ("lm_head",) and self.config.vocab_size % self.mesh.size == 0:
            return P(None, TP_AXIS)
        return P()

    def sharding(self, path: ParamPath) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(path))

    def scale_sharding(self, path: ParamPath, ndim: int) -> NamedSharding:
        """Where the scales of the quantized weight ``[..., in, out]`` at ``path`` go."""
        return NamedSharding(self.mesh, scale_spec(self.spec(path), ndim))

    def _selection(self, path: ParamPath, shape: tuple[int, ...]) -> tuple[np.ndarray, int] | None:
        """(source index, axis) that maps an original tensor into the sharded layout, or
        None when the layout keeps it as is."""
        name = path[-1]
        if name in _QUERY:
            index, axis = self._index["q"], 0 if name == "wo" else len(shape) - 1
        elif name in _KEY_VALUE:
            index, axis = self._index["kv"], len(shape) - 1
        elif name in ("w_gate", "w_up", "w_down"):
            index, axis = self._index["ffn"], 0 if name == "w_down" else 1
        else:
            return None
        if index.size == shape[axis] and (index == np.arange(index.size)).all():
            return None
        return index, axis

    def transform(self, path: ParamPath, w: Any) -> Any:
        """Original-layout tensor -> sharded-model layout (numpy or jax, same kind out)."""
        selection = self._selection(path, tuple(w.shape))
        return w if selection is None else _take(w, *selection)

    def transform_scale(self, path: ParamPath, scale: Any) -> Any:
        """A quantized weight's scales ``[..., out]`` -> the sharded layout: the columns
        the weight's ``transform`` selects, scale 1 for a zero column (what ``quantize``
        gives an all-zero column); a row selection leaves them as they are."""
        weight_shape = (*scale.shape[:-1], 0, scale.shape[-1])  # [..., in (any), out]
        selection = self._selection(path, weight_shape)
        if selection is None or selection[1] != scale.ndim:
            return scale
        return _take(scale, selection[0], scale.ndim - 1, fill=1)

    def reshard_scale(self, path: ParamPath, scale: jax.Array) -> jax.Array:
        """``transform_scale`` on device, into ``scale_sharding`` (one compile per name)."""
        sharding = self.scale_sharding(path, scale.ndim + 1)
        key = ("scale", path[-1], sharding)
        if key not in self._reshard_fns:
            name_path = (path[-1],)
            self._reshard_fns[key] = jax.jit(lambda s: self.transform_scale(name_path, s),
                                             out_shardings=sharding)
        return self._reshard_fns[key](scale)

    def place_scale(self, path: ParamPath, scale: Any) -> jax.Array:
        """``place`` for a quantized weight's scales (``transform_scale``)."""
        host = np.asarray(self.transform_scale(path, np.asarray(scale)))
        return jax.make_array_from_callback(
            host.shape, self.scale_sharding(path, host.ndim + 1), lambda index: host[index])

    def place(self, path: ParamPath, w: Any, dtype: Any) -> jax.Array:
        """Transform one host tensor and put each shard's slice on its device. Only this
        process's devices get a slice (``make_array_from_callback``): across hosts, each
        process places its own shards of the global array."""
        host = np.asarray(w)
        host = self.transform(path, host).astype(dtype, copy=False)
        return jax.make_array_from_callback(host.shape, self.sharding(path),
                                            lambda index: host[index])

    def reshard(self, path: ParamPath, w: jax.Array) -> jax.Array:
        """Transform one device tensor (any sharding) into its sharded layout, on device.

        One jitted conversion per parameter name: every layer's ``wq`` shares a compile."""
        sharding = self.sharding(path)
        if self._selection(path, tuple(w.shape)) is None:
            return jax.device_put(w, sharding)
        key = (path[-1], sharding)
        if key not in self._reshard_fns:
            name_path = (path[-1],)
            self._reshard_fns[key] = jax.jit(lambda x: self.transform(name_path, x),
                                             out_shardings=sharding)
        return self._reshard_fns[key](w)

    def restore_sharding(self, path: ParamPath, shape: tuple[int, ...]) -> NamedSharding:
        """Where to read an original-layout tensor from a checkpoint: its final sharding
        when the layout leaves it as is, else split the same way if that divides evenly
        (then ``reshard`` it), else replicated."""
        spec = self.spec(path)
        uneven = any(axis is not None and dim % self.mesh.size
                     for dim, axis in zip(shape, spec, strict=False))
        return NamedSharding(self.mesh, P() if uneven else spec)

    def describe(self) -> str:
        lay, cfg = self.layout, self.config
        zero_q = lay.q_source.count(-1)
        return (f"tp={self.mesh.size}: {cfg.num_kv_heads} KV heads -> {lay.num_kv_heads} "
                f"(x{lay.kv_replicas} replicas, {lay.kv_source.count(-1)} zero), "
                f"{cfg.num_heads} query heads -> {lay.num_heads} ({zero_q} zero), "
                f"ffn {cfg.intermediate_size} -> {lay.intermediate_size}")


def flat_state(state: Any) -> dict[ParamPath, Any]:
    """``{("layers", 0, "attn", "wq"): array, ...}`` of an NNX state."""
    return dict(nnx.traversals.flatten_mapping(nnx.to_pure_dict(state)))


def fill_state(state: Any, values: dict[ParamPath, Any]) -> None:
    nnx.replace_by_pure_dict(state, nnx.traversals.unflatten_mapping(values))
