"""Weight-only quantization (``model.quantization``): int8 and fp8 e4m3 weights with one
float32 scale per output channel, and the matmuls that read them.

``QuantizedWeight`` is a pytree (``q`` and ``scale``) that sits in an ``nnx.Param`` where a
float weight ``[..., in, out]`` sat: ``q`` keeps its shape in one byte per element and
``scale`` drops the contraction axis (``[..., out]``), so a dense projection ``[in, out]``
and a stack of expert weights ``[E, in, out]`` share the form. The dequantized weight is
``q * scale[..., None, :]``. ``quantize_params`` swaps every projection of a model's state
for one (embeddings, norms, biases and MoE routers stay float), after any loader and
after sharding, so every checkpoint format and every architecture gets it the same way.

How a quantized projection computes (``matmuls``), by platform:

- CPU: bfloat16 activations times the weight, float32 accumulation, then the scales (W8A16
  for int8; fp8 weights compute the same way). Through the native kernel
  (``superinfer_jax.ops.native.quant_matmuls``) where the CPU has AVX512-BF16 and the
  model is on one device, else XLA's dot of ``q`` converted to bfloat16.
- CUDA, fp8: activations scaled per token into e4m3 and one ``f8E4M3FN x f8E4M3FN`` dot
  with float32 accumulation, then both scales: the form XLA's GPU compiler turns into an
  FP8 GEMM. CUDA, int8 (and any other platform): the bfloat16 form above.

Per-token and per-channel scales only: no scale depends on another row, so greedy tokens
stay independent of batching within a mode.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from superinfer_jax.ops import native

MODES = ("none", "int8", "fp8")
QDTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
_QMAX = {"int8": 127.0, "fp8": float(jnp.finfo(jnp.float8_e4m3fn).max)}  # 448 for e4m3
# Parameter names never quantized: the token embedding is a gather, not a matmul, and a
# MoE router's few columns decide which experts run.
FLOAT_PARAMS = ("embed", "router")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"model.quantization must be one of {' | '.join(MODES)}, got {mode!r}")
    return mode


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """``q [..., in, out]`` (int8 or float8_e4m3fn) and ``scale [..., out]`` float32.

    ``panel``: 0 when ``q`` is row-major; else ``q`` (still shaped ``[in, out]``) holds its
    columns packed in panels of that width (``pack_columns``), the layout the native CPU
    kernel streams fastest. Only ``matmuls``' native path reads a packed ``q`` as it is;
    every other reader takes ``unpacked_q``."""

    q: jax.Array
    scale: jax.Array
    panel: int = dataclasses.field(default=0, metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    @property
    def mode(self) -> str:
        return "int8" if self.q.dtype == jnp.int8 else "fp8"

    def __getitem__(self, index: Any) -> QuantizedWeight:
        """``param[...]`` (how the models read a weight) is the weight itself."""
        if index is not Ellipsis:
            raise TypeError("a QuantizedWeight is read whole (param[...])")
        return self

    @property
    def unpacked_q(self) -> jax.Array:
        """``q`` row-major ``[..., in, out]``, whatever its storage."""
        return unpack_columns(self.q, self.panel) if self.panel else self.q

    def dequantize(self, dtype: Any = jnp.float32) -> jax.Array:
        return (self.unpacked_q.astype(jnp.float32) * self.scale[..., None, :]).astype(dtype)


def pack_columns(q: jax.Array, panel: int) -> jax.Array:
    """``q [in, out]`` with its columns packed in panels of ``panel`` (same shape): panel p,
    columns ``[p * panel, p * panel + w_p)``, as its own row-major ``[in, w_p]`` block,
    blocks end to end (``superinfer_jax/ops/native/quant_matmul.cc``)."""
    rows, cols = q.shape
    full = cols // panel * panel
    blocks = [q[:, :full].reshape(rows, -1, panel).transpose(1, 0, 2).reshape(-1)]
    if full < cols:
        blocks.append(q[:, full:].reshape(-1))
    return jnp.concatenate(blocks).reshape(rows, cols)


def unpack_columns(q: jax.Array, panel: int) -> jax.Array:
    """``pack_columns``' inverse."""
    rows, cols = q.shape
    full = cols // panel * panel
    flat = q.reshape(-1)
    parts = [flat[:rows * full].reshape(-1, rows, panel).transpose(1, 0, 2).reshape(rows, full)]
    if full < cols:
        parts.append(flat[rows * full:].reshape(rows, cols - full))
    return jnp.concatenate(parts, axis=1)


def pack_params(params: nnx.State, panel: int) -> nnx.State:
    """``params`` with every row-major two-axis quantized weight packed in ``panel``
    columns (expert stacks and packed weights stay as they are); one device only."""
    from models.sharding import fill_state, flat_state

    flat = flat_state(params)
    for path, w in flat.items():
        if isinstance(w, QuantizedWeight) and w.q.ndim == 2 and not w.panel:
            flat[path] = QuantizedWeight(_pack_jit(w.q, panel), w.scale, panel)
    fill_state(params, flat)
    return params


_pack_jit = jax.jit(pack_columns, static_argnums=(1,))


def quantize(w: jax.Array, mode: str) -> QuantizedWeight:
    """Symmetric per-output-channel quantization of ``w [..., in, out]``: each column's
    largest magnitude maps to the format's largest value (127, or 448 for e4m3); int8
    rounds to nearest, fp8 to the nearest e4m3 value. An all-zero column gets scale 1."""
    if mode not in QDTYPES:
        raise ValueError(f"quantize: mode must be one of {tuple(QDTYPES)}, got {mode!r}")
    if w.ndim < 2:
        raise ValueError(f"quantize: a weight [..., in, out] has >= 2 axes, got {w.shape}")
    w32 = jnp.asarray(w, jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=-2)
    # Products with reciprocals, not divisions (XLA may rewrite a division into one):
    # one rounding rule that a host-side quantizer (models.loaders.gguf_q8) reproduces.
    scale = jnp.where(amax > 0, amax * np.float32(1.0 / _QMAX[mode]), 1.0).astype(jnp.float32)
    scaled = w32 * (1.0 / scale)[..., None, :]
    if mode == "int8":
        q = jnp.clip(jnp.round(scaled), -127, 127).astype(jnp.int8)
    else:
        q = jnp.clip(scaled, -_QMAX[mode], _QMAX[mode]).astype(jnp.float8_e4m3fn)
    return QuantizedWeight(q, scale)


def quantized_path(path: tuple[Any, ...], value: Any) -> bool:
    """Whether the parameter at ``path`` is a projection ``quantize_params`` quantizes."""
    name = str(path[-1])
    return getattr(value, "ndim", 0) >= 2 and not any(f in name for f in FLOAT_PARAMS)


@functools.partial(jax.jit, static_argnums=(1, 2))
def quantize_placed(w: jax.Array, mode: str, shardings: tuple[Any, Any] | None = None
                    ) -> QuantizedWeight:
    """``quantize`` as one compiled program; ``shardings`` (``q``'s and the scales', from
    ``models.sharding.ShardPlan``): where the results go under tensor parallelism, ``q``
    split like ``w`` and the scales with their columns (a row-split ``w``'s column
    maxima are taken over every shard's rows)."""
    out = quantize(w, mode)
    if shardings is None:
        return out
    return QuantizedWeight(jax.lax.with_sharding_constraint(out.q, shardings[0]),
                           jax.lax.with_sharding_constraint(out.scale, shardings[1]))


def plan_shardings(plan: Any, path: tuple[Any, ...], ndim: int) -> tuple[Any, Any] | None:
    """``quantize_placed``'s shardings for the weight at ``path`` under ``plan`` (a
    ``models.sharding.ShardPlan``, or None on one device)."""
    if plan is None:
        return None
    return plan.sharding(path), plan.scale_sharding(path, ndim)


def quantize_params(params: nnx.State, mode: str, plan: Any = None) -> nnx.State:
    """``params`` (a model's ``nnx.split`` state) with every projection weight
    quantized, one tensor at a time. With ``plan`` (the model's ``ShardPlan``), the
    weights are sharded and stay so: ``q`` keeps ``w``'s layout and the scales follow
    their columns (``models.sharding.scale_spec``)."""
    from models.sharding import fill_state, flat_state

    if check_mode(mode) == "none":
        return params
    flat = flat_state(params)
    for path, value in flat.items():
        if isinstance(value, QuantizedWeight):
            raise ValueError(f"{'.'.join(map(str, path))} is already quantized "
                             f"({value.mode}); load the model again")
        if quantized_path(path, value):
            flat[path] = quantize_placed(value, mode, plan_shardings(plan, path, value.ndim))
    fill_state(params, flat)
    return params


def is_quantized(params: Any) -> bool:
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    return any(isinstance(x, QuantizedWeight) for x in leaves)


def _pad_one_row(x2: jax.Array) -> jax.Array:
    # XLA:CPU lowers a one-row dot as a matrix-vector product that converts the whole
    # weight to float32 first; two rows take its matrix kernel (models.llama._dot_acc32).
    return jnp.pad(x2, ((0, 1), (0, 0))) if x2.shape[0] == 1 else x2


def _bf16_dot(x2: jax.Array, w: QuantizedWeight) -> jax.Array:
    """bfloat16 x times ``q`` (exact in bfloat16), float32 sums, times the scales."""
    rows = x2.shape[0]
    out = jnp.dot(_pad_one_row(x2.astype(jnp.bfloat16)), w.unpacked_q.astype(jnp.bfloat16),
                  preferred_element_type=jnp.float32)[:rows]
    return out * w.scale


def fp8_gemm(x2: jax.Array, w: QuantizedWeight) -> jax.Array:
    """The CUDA form: x scaled per row into e4m3, one f8 x f8 dot with float32
    accumulation, then the row and column scales (XLA rewrites it to an FP8 GEMM)."""
    x32 = x2.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
    x_scale = jnp.where(amax > 0, amax / _QMAX["fp8"], 1.0)
    x8 = (x32 / x_scale).astype(jnp.float8_e4m3fn)
    out = jax.lax.dot_general(x8, w.unpacked_q, (((1,), (0,)), ((), ())),
                              preferred_element_type=jnp.float32)
    return out * x_scale * w.scale


def _xla(x2: jax.Array, ws: Sequence[QuantizedWeight]) -> list[jax.Array]:
    return [_bf16_dot(x2, w) for w in ws]


def _gpu(x2: jax.Array, ws: Sequence[QuantizedWeight]) -> list[jax.Array]:
    return [fp8_gemm(x2, w) if w.mode == "fp8" else _bf16_dot(x2, w) for w in ws]


def matmuls(x: jax.Array, ws: Sequence[QuantizedWeight], native_cpu: bool) -> list[jax.Array]:
    """``[x @ w.dequantize() for w in ws]`` for x [..., in], float32 results (forms: the
    module docstring). ``native_cpu``: the CPU program calls the native kernel (every
    shape, so a row's bits never depend on its batch); else XLA's dot on CPU."""
    lead, rows = x.shape[:-1], math.prod(x.shape[:-1])
    x2 = x.reshape(rows, x.shape[-1])
    modes = {w.mode for w in ws}
    panels = {w.panel for w in ws}
    if native_cpu and len(modes) == 1 and len(panels) == 1 and \
            len(ws) <= native.MAX_MATMUL_WEIGHTS:
        def cpu(x2, ws):
            return native.quant_matmuls(native.matmul_rows(x2), [(w.q, w.scale) for w in ws],
                                        panel=ws[0].panel)
    else:
        cpu = _xla
    outs = jax.lax.platform_dependent(x2, list(ws), cpu=cpu, cuda=_gpu, default=_xla)
    return [out.reshape(*lead, w.shape[-1]) for out, w in zip(outs, ws, strict=True)]


def grouped_matmul(lhs: jax.Array, w: QuantizedWeight, group_sizes: jax.Array) -> jax.Array:
    """``superinfer_jax.ops.grouped_matmul`` with stacked quantized experts ``[E, in, out]``:
    bfloat16 rows times each group's ``q``, float32 sums, then that group's scales."""
    from superinfer_jax.ops.grouped_matmul import grouped_matmul as dense

    if w.q.ndim != 3:
        raise ValueError(f"grouped_matmul: experts [E, in, out], got {w.shape}")
    out = dense(lhs.astype(jnp.bfloat16), w.q.astype(jnp.bfloat16), group_sizes,
                preferred_element_type=jnp.float32)
    ends = jnp.cumsum(group_sizes)
    group = jnp.minimum(jnp.searchsorted(ends, jnp.arange(lhs.shape[0]), side="right"),
                        w.q.shape[0] - 1)
    return out * w.scale[group]


def weight_bytes(params: Any) -> int:
    """Bytes of every array in ``params`` (quantized weights count q and scale)."""
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(params))
