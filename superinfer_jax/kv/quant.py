"""KV cache dtypes: what a page stores, and how a float K/V goes in and comes back out.

``model.kv_cache_dtype`` names one of ``KV_DTYPES``. ``float32`` and ``bfloat16`` store the
values as they are (on CPU bfloat16 as its bits in ``uint16``, ``CPU_STORAGE``). The fp8
modes store one byte per element:

- ``fp8_e5m2``: the value rounded to e5m2 (2 mantissa bits, range +-57344), no scale.
- ``fp8_e4m3``: the value divided by a scale, rounded to e4m3fn (3 mantissa bits, range
  +-448). The scales are fixed per layer and KV head, for K and V apart (``[L, 2, K]``
  float32): calibrated once when the engine starts (``runner.kv_calibration``) and never
  changed after. A page's bytes therefore mean the same thing on every engine of one
  model, in either tier and in the prefix cache, so DuplexKV's one-copy page move and
  prefix sharing stay byte-exact with no per-page metadata to move.

Values past the range saturate (clipped) rather than become inf/NaN. Attention folds
the scales out of its inner loop: ``q . (s_k k) = (s_k q) . k`` and ``sum p (s_v v) =
s_v sum p v`` for one head, so the kernels read the stored bytes and cast.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

KV_DTYPES = ("float32", "bfloat16", "fp8_e4m3", "fp8_e5m2")
# Storage dtype of each mode (the pool's jnp dtype)
STORAGE = {"float32": "float32", "bfloat16": "bfloat16",
           "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
# On CPU a bfloat16 or fp8 pool holds the same bytes as integers: XLA:CPU upcasts an
# in-place update of a bfloat16 or fp8 array over the whole array (a copy of the pool per
# layer written), while an integer scatter stays in place. Each format has its own
# stand-in, so the pool's dtype alone says how to read it.
CPU_STORAGE = {"bfloat16": "uint16", "fp8_e4m3": "uint8", "fp8_e5m2": "int8"}
_FLOAT_OF = {jnp.dtype(jnp.uint16): jnp.dtype(jnp.bfloat16),
             jnp.dtype(jnp.uint8): jnp.dtype(jnp.float8_e4m3fn),
             jnp.dtype(jnp.int8): jnp.dtype(jnp.float8_e5m2),
             jnp.dtype(jnp.float8_e4m3fn): jnp.dtype(jnp.float8_e4m3fn),
             jnp.dtype(jnp.float8_e5m2): jnp.dtype(jnp.float8_e5m2)}
_FP8_TYPES = frozenset({jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)})
SCALED = frozenset({"fp8_e4m3"})  # modes whose pages need the per-layer, per-head scales
FP8 = frozenset({"fp8_e4m3", "fp8_e5m2"})
# Calibration maps ``HEADROOM`` times the largest calibrated |value| to the e4m3 maximum:
# fp8's relative precision is the same over its whole normal range (2^-6 .. 448), so the
# headroom costs precision only on values below ``HEADROOM * amax / 448 / 64`` (subnormal),
# and it keeps a prompt whose keys are larger than the calibration text's from saturating.
HEADROOM = 4.0
SCALE_BYTES_PER_ENTRY = 4  # float32


def storage_dtype(kv_cache_dtype: str, platform: str | None = None) -> jnp.dtype:
    """The pool's element type for ``kv_cache_dtype`` on ``platform`` (default: JAX's
    default backend; ``CPU_STORAGE`` there); a plain element type name (``uint16``) is
    taken as itself. The config admits only ``KV_DTYPES``."""
    if (platform or jax.default_backend()) == "cpu" and kv_cache_dtype in CPU_STORAGE:
        return jnp.dtype(CPU_STORAGE[kv_cache_dtype])
    try:
        return jnp.dtype(STORAGE.get(kv_cache_dtype, kv_cache_dtype))
    except TypeError as e:
        raise ValueError(f"model.kv_cache_dtype must be one of {KV_DTYPES}, "
                         f"got {kv_cache_dtype!r}") from e


def is_fp8(dtype: jnp.dtype | np.dtype) -> bool:
    """Whether a pool of this element type holds fp8 bytes (as fp8, or a CPU stand-in)."""
    return _FLOAT_OF.get(jnp.dtype(dtype)) in _FP8_TYPES


def as_float(x: jax.Array) -> jax.Array:
    """Stored values as their float type (a CPU stand-in bitcast, same bytes); any other
    array as it is. Readers cast the result to their compute dtype."""
    float_type = _FLOAT_OF.get(jnp.dtype(x.dtype))
    if float_type is None or float_type == jnp.dtype(x.dtype):
        return x
    return jax.lax.bitcast_convert_type(x, float_type)


def quantize(x: jax.Array, dtype: jnp.dtype, scale: jax.Array | None = None) -> jax.Array:
    """``x`` stored as ``dtype``: divided by ``scale`` (broadcast) when given, clipped to
    the fp8 range so nothing overflows to inf or NaN, and bitcast to a CPU stand-in's
    integers; a float pool just casts."""
    dtype = jnp.dtype(dtype)
    if not is_fp8(dtype):
        float_type = _FLOAT_OF.get(dtype, dtype)
        q = x.astype(float_type)
        return q if float_type == dtype else jax.lax.bitcast_convert_type(q, dtype)
    fp8 = _FLOAT_OF[dtype]
    x = x.astype(jnp.float32)
    if scale is not None:
        x = x / scale
    limit = float(jnp.finfo(fp8).max)
    q = jnp.clip(x, -limit, limit).astype(fp8)
    return q if fp8 == dtype else jax.lax.bitcast_convert_type(q, dtype)


def dequantize(x: jax.Array, scale: jax.Array | None = None) -> jax.Array:
    """Stored values back in float32 (times ``scale`` when given): the reference that
    attention's folded scales are tested against."""
    x = as_float(x).astype(jnp.float32)
    return x if scale is None else x * scale


def scales_from_amax(amax: np.ndarray) -> np.ndarray:
    """Per-head scales ``[L, 2, K]`` from the calibrated max |value|: ``HEADROOM * amax``
    maps to the e4m3 maximum; a head that never saw a nonzero value gets 1."""
    amax = np.asarray(amax, np.float32)
    limit = float(jnp.finfo(jnp.float8_e4m3fn).max)
    scales = np.where(amax > 0, amax * HEADROOM / limit, 1.0)
    return scales.astype(np.float32)


def scale_bytes(kv_cache_dtype: str, num_layers: int, num_kv_heads: int) -> int:
    """Bytes of the engine's scale array (counted once against the KV byte budget)."""
    if kv_cache_dtype not in SCALED:
        return 0
    return num_layers * 2 * num_kv_heads * SCALE_BYTES_PER_ENTRY
