"""Weight quantization (``model.quantization``): int8 and fp8 e4m3 weights with one float32
scale per output channel (weight-only), or int8 weights with int8 activations scaled per
token (``w8a8_int8``), and the matmuls that read them.

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
- W8A8 (``w8a8_int8``, every platform): each row of x rotated by a block Hadamard
  transform and quantized to int8 with its own scale (``quantize_rows``), an int8 x int8
  dot summed exactly in int32 against the weight rotated the same way before it was
  quantized, then the row's and the column's scales (``w8a8_dot``). The rotation (as in
  QuaRot, arXiv:2404.00456) spreads the few outlier channels of a normed activation over
  a block of ``rotation_block(in)`` channels, so one scale per token keeps the small ones:
  on SmolLM2-135M it takes W8A8's perplexity change from 4.0% to under 1%
  (docs/results/quantization.md). On CPU through the native kernel
  (``superinfer_jax.ops.native.w8a8_matmuls``, AVX512-VNNI and AMX-INT8, the same bits
  as ``w8a8_dot``) where it runs and the model is on one device. Expert stacks
  ``[E, in, out]`` stay weight-only int8 (the grouped matmul has no W8A8 form).
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

MODES = ("none", "int8", "fp8", "w8a8_int8")
QDTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "w8a8_int8": jnp.int8}
_QMAX = {"int8": 127.0, "fp8": float(jnp.finfo(jnp.float8_e4m3fn).max),  # 448 for e4m3
         "w8a8_int8": 127.0}
W8A8 = "w8a8_int8"
# Parameter names never quantized: the token embedding is a gather, not a matmul, and a
# MoE router's few columns decide which experts run.
FLOAT_PARAMS = ("embed", "router")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"model.quantization must be one of {' | '.join(MODES)}, got {mode!r}")
    return mode


ROTATION_MAX = 256  # the widest Hadamard block W8A8 rotates in


def rotation_block(k: int) -> int:
    """The Hadamard block W8A8 rotates ``k`` input channels in: the largest power of two
    that divides k, at most ``ROTATION_MAX``."""
    block = 1
    while block < ROTATION_MAX and k % (2 * block) == 0:
        block *= 2
    return block


def hadamard(x: jax.Array, block: int, axis: int = -1) -> jax.Array:
    """``x`` times the Sylvester Hadamard matrix of order ``block`` (entries +-1, not
    normalised) along ``axis``, block by block: the fast Walsh-Hadamard transform, stages
    h = 1, 2, 4, ... each replacing the pair (a, c) h apart by (a + c, a - c). The native
    W8A8 kernel runs the same stages, so the two give the same bits."""
    x = jnp.moveaxis(x, axis, -1)
    lead, k = x.shape[:-1], x.shape[-1]
    h = 1
    while h < block:
        pairs = x.reshape(*lead, k // (2 * h), 2, h)
        a, c = pairs[..., 0, :], pairs[..., 1, :]
        x = jnp.stack([a + c, a - c], axis=-2).reshape(*lead, k)
        h *= 2
    return jnp.moveaxis(x, -1, axis)


def check_one_device(mode: str, devices: int) -> None:
    """W8A8 weights are rotated along their input rows, which a tensor-parallel plan may
    pad (heads, the FFN width): refused on more than one device, naming the key."""
    if mode == W8A8 and devices > 1:
        raise ValueError(f"model.quantization: {W8A8} runs on one device, got "
                         f"tensor_parallel_size {devices}; use int8 or fp8 weights there")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """``q [..., in, out]`` (int8 or float8_e4m3fn) and ``scale [..., out]`` float32.

    ``panel``: 0 when ``q`` is row-major; else ``q`` (still shaped ``[in, out]``) holds its
    columns packed in panels of that width (``pack_columns``), the layout the native CPU
    kernel streams fastest. Only ``matmuls``' native path reads a packed ``q`` as it is;
    every other reader takes ``unpacked_q``.

    ``w8a8``: the activations are quantized too (``w8a8_int8``); a packed W8A8 ``q`` is
    uint8 in ``pack_w8a8``'s layout (``panel`` is then its block width)."""

    q: jax.Array
    scale: jax.Array
    panel: int = dataclasses.field(default=0, metadata={"static": True})
    w8a8: bool = dataclasses.field(default=False, metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    @property
    def mode(self) -> str:
        if self.w8a8:
            return W8A8
        return "int8" if self.q.dtype == jnp.int8 else "fp8"

    def __getitem__(self, index: Any) -> QuantizedWeight:
        """``param[...]`` (how the models read a weight) is the weight itself."""
        if index is not Ellipsis:
            raise TypeError("a QuantizedWeight is read whole (param[...])")
        return self

    @property
    def unpacked_q(self) -> jax.Array:
        """``q`` row-major ``[..., in, out]`` (int8 or e4m3), whatever its storage."""
        if not self.panel:
            return self.q
        return unpack_w8a8(self.q) if self.w8a8 else unpack_columns(self.q, self.panel)

    def row_major(self) -> QuantizedWeight:
        """This weight with ``q`` row-major (what sharding and slicing work on)."""
        return dataclasses.replace(self, q=self.unpacked_q, panel=0)

    def dequantize(self, dtype: Any = jnp.float32) -> jax.Array:
        w = self.unpacked_q.astype(jnp.float32) * self.scale[..., None, :]
        if self.w8a8:  # stored rotated, H w / b: H (H w / b) = w
            w = hadamard(w, rotation_block(w.shape[-2]), axis=-2)
        return w.astype(dtype)


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


def pack_w8a8(q: jax.Array) -> jax.Array:
    """int8 ``q [in, out]`` (``in`` a multiple of 4) as the native W8A8 kernel reads it,
    uint8 of the same shape: ``q + 128``, in blocks of ``native.W8A8_BLOCK`` columns end
    to end, block b (width w_b) holding ``[in / 4, w_b, 4]``: for each group of four rows,
    each column's four values side by side (``superinfer_jax/ops/native/w8a8_matmul.cc``)."""
    rows, cols = q.shape
    if rows % 4:
        raise ValueError(f"pack_w8a8: in-features must be a multiple of 4, got {rows}")
    u = (q.astype(jnp.int16) + 128).astype(jnp.uint8)
    block = native.W8A8_BLOCK
    full = cols // block * block
    parts = []
    if full:
        parts.append(u[:, :full].reshape(rows // 4, 4, full // block, block)
                     .transpose(2, 0, 3, 1).reshape(-1))
    if full < cols:
        parts.append(u[:, full:].reshape(rows // 4, 4, cols - full).transpose(0, 2, 1)
                     .reshape(-1))
    return jnp.concatenate(parts).reshape(rows, cols)


def unpack_w8a8(packed: jax.Array) -> jax.Array:
    """``pack_w8a8``'s inverse (int8 ``[in, out]``)."""
    rows, cols = packed.shape
    block = native.W8A8_BLOCK
    full = cols // block * block
    flat = packed.reshape(-1)
    parts = []
    if full:
        parts.append(flat[:rows * full].reshape(full // block, rows // 4, block, 4)
                     .transpose(1, 3, 0, 2).reshape(rows, full))
    if full < cols:
        parts.append(flat[rows * full:].reshape(rows // 4, cols - full, 4).transpose(0, 2, 1)
                     .reshape(rows, cols - full))
    u = jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
    return (u.astype(jnp.int16) - 128).astype(jnp.int8)


def pack_params(params: nnx.State, panel: int, w8a8: bool = False) -> nnx.State:
    """``params`` with every row-major two-axis quantized weight packed for the native
    kernels (expert stacks and packed weights stay as they are; one device only):
    weight-only ones in ``panel`` columns, W8A8 ones by ``pack_w8a8`` when ``w8a8`` (its
    kernel runs here)."""
    from models.sharding import fill_state, flat_state

    flat = flat_state(params)
    for path, w in flat.items():
        if not isinstance(w, QuantizedWeight) or w.q.ndim != 2 or w.panel:
            continue
        if w.w8a8:
            if w8a8 and w.q.shape[0] % 4 == 0:
                flat[path] = QuantizedWeight(_pack_w8a8_jit(w.q), w.scale, native.W8A8_BLOCK,
                                             True)
        else:
            flat[path] = QuantizedWeight(_pack_jit(w.q, panel), w.scale, panel)
    fill_state(params, flat)
    return params


_pack_jit = jax.jit(pack_columns, static_argnums=(1,))
_pack_w8a8_jit = jax.jit(pack_w8a8)


def quantize(w: jax.Array, mode: str) -> QuantizedWeight:
    """Symmetric per-output-channel quantization of ``w [..., in, out]``: each column's
    largest magnitude maps to the format's largest value (127, or 448 for e4m3); int8
    rounds to nearest, fp8 to the nearest e4m3 value. An all-zero column gets scale 1.
    ``w8a8_int8`` rotates the weight's rows first, ``hadamard(w, b, axis=-2) / b`` with
    b = ``rotation_block(in)`` (what ``quantize_rows`` does to x, undone: H H = b I), then
    quantizes it as ``int8`` does and marks it ``w8a8``."""
    if mode not in QDTYPES:
        raise ValueError(f"quantize: mode must be one of {tuple(QDTYPES)}, got {mode!r}")
    if w.ndim < 2:
        raise ValueError(f"quantize: a weight [..., in, out] has >= 2 axes, got {w.shape}")
    w32 = jnp.asarray(w, jnp.float32)
    if mode == W8A8:
        block = rotation_block(w32.shape[-2])
        w32 = hadamard(w32, block, axis=-2) * np.float32(1.0 / block)
    amax = jnp.max(jnp.abs(w32), axis=-2)
    # Products with reciprocals, not divisions (XLA may rewrite a division into one):
    # one rounding rule that a host-side quantizer (models.loaders.gguf_q8) reproduces.
    scale = jnp.where(amax > 0, amax * np.float32(1.0 / _QMAX[mode]), 1.0).astype(jnp.float32)
    scaled = w32 * (1.0 / scale)[..., None, :]
    if mode in ("int8", W8A8):
        q = jnp.clip(jnp.round(scaled), -127, 127).astype(jnp.int8)
    else:
        q = jnp.clip(scaled, -_QMAX[mode], _QMAX[mode]).astype(jnp.float8_e4m3fn)
    return QuantizedWeight(q, scale, w8a8=mode == W8A8)


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
    return dataclasses.replace(out, q=jax.lax.with_sharding_constraint(out.q, shardings[0]),
                               scale=jax.lax.with_sharding_constraint(out.scale, shardings[1]))


def plan_shardings(plan: Any, path: tuple[Any, ...], ndim: int) -> tuple[Any, Any] | None:
    """``quantize_placed``'s shardings for the weight at ``path`` under ``plan`` (a
    ``models.sharding.ShardPlan``, or None on one device)."""
    if plan is None:
        return None
    return plan.sharding(path), plan.scale_sharding(path, ndim)


def mode_for(mode: str, ndim: int) -> str:
    """The mode a weight of ``ndim`` axes takes under ``mode``: expert stacks (3 axes and
    more) stay weight-only int8 under ``w8a8_int8``."""
    return "int8" if mode == W8A8 and ndim > 2 else mode


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
            flat[path] = quantize_placed(value, mode_for(mode, value.ndim),
                                         plan_shardings(plan, path, value.ndim))
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


def quantize_rows(x2: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row of ``x2 [M, K]`` rotated (``hadamard`` in blocks of ``rotation_block(K)``),
    as int8 and its float32 scale ``[M, 1]``: the row's largest magnitude maps to 127,
    values round half to even (the W8A8 kernel's exact rule)."""
    x32 = hadamard(x2.astype(jnp.float32), rotation_block(x2.shape[-1]))
    amax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax * np.float32(1.0 / 127.0), np.float32(1.0))
    q = jnp.clip(jnp.round(x32 * (np.float32(1.0) / scale)), -127, 127).astype(jnp.int8)
    return q, scale


def w8a8_dot(x2: jax.Array, w: QuantizedWeight) -> jax.Array:
    """W8A8 in XLA: x quantized per row, an int8 dot summed in int32 (exact), then
    ``(float(sum) * s_x) * s_w``, the native kernel's bits."""
    xq, x_scale = quantize_rows(x2)
    acc = jax.lax.dot_general(xq, w.unpacked_q, (((1,), (0,)), ((), ())),
                              preferred_element_type=jnp.int32)
    return (acc.astype(jnp.float32) * x_scale) * w.scale


def _w8a8_xla(x2: jax.Array, ws: Sequence[QuantizedWeight]) -> list[jax.Array]:
    return [w8a8_dot(x2, w) for w in ws]


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
    if W8A8 in modes:
        if len(modes) > 1:
            return [out for w in ws for out in matmuls(x, [w], native_cpu)]
        if native_cpu and panels == {native.W8A8_BLOCK} and \
                len(ws) <= native.MAX_MATMUL_WEIGHTS:
            def w8a8_cpu(x2, ws):
                return native.w8a8_matmuls(native.matmul_rows(x2), [(w.q, w.scale) for w in ws],
                                           rotation=rotation_block(x2.shape[-1]))
        else:
            w8a8_cpu = _w8a8_xla
        outs = jax.lax.platform_dependent(x2, list(ws), cpu=w8a8_cpu, default=_w8a8_xla)
        return [out.reshape(*lead, w.shape[-1]) for out, w in zip(outs, ws, strict=True)]
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
