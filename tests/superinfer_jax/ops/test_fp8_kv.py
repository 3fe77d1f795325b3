"""fp8 KV pages against plain jnp references.

The write stores exactly the bytes a plain ``clip(x / scale).astype(fp8)`` gives, and
reading them back errs by at most half an fp8 spacing; attention over fp8 pages (XLA
loop and Pallas kernel, which fold the per-head scales into the query and the output)
equals dense attention over the dequantized values to float32 rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from superinfer_jax import ops
from superinfer_jax.kv import quant
from superinfer_jax.ops import attention_pallas, attention_xla
from tests.numerics import assert_close, attention_tolerance

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# (mode, stored format, mantissa bits, smallest subnormal exponent); bfloat16 is here for
# its CPU stand-in, which takes the same write and read paths as fp8's
FORMATS = [("fp8_e4m3", E4M3, 3, -9), ("fp8_e5m2", E5M2, 2, -16),
           ("bfloat16", jnp.bfloat16, 7, -133)]
# each format as a GPU pool stores it (the float type) and as a CPU pool does (its
# integer stand-in, ``kv.quant.CPU_STORAGE``): the same bytes either way
MODES = [(mode, fmt, quant.storage_dtype(mode, platform), m, e)
         for mode, fmt, m, e in FORMATS for platform in ("gpu", "cpu")]
LAYER = 1


def _reference_bytes(x: np.ndarray, dtype, scale: np.ndarray | None) -> np.ndarray:
    """The plain jnp quantization, written out independently of ``kv.quant``."""
    y = jnp.asarray(x, jnp.float32)
    if scale is not None:
        y = y / jnp.asarray(scale)
    limit = float(jnp.finfo(dtype).max)
    return np.asarray(jnp.clip(y, -limit, limit).astype(dtype))


def _heads(rng, t: int, k: int, d: int, spread: np.ndarray) -> np.ndarray:
    """[T, K, D] values whose magnitude differs per head (``spread`` [K])."""
    return (rng.standard_normal((t, k, d)) * spread[None, :, None]).astype(np.float32)


@functools.partial(jax.jit, static_argnames=("backend",))
def _write_attend(pool, q, k, v, table, pos, ctx, qlen, scales, backend="xla"):
    """One layer's write then attention, as a model layer calls it."""
    return ops.write_and_attend(q, k, v, pool, LAYER, table, pos, ctx, qlen,
                                scale=q.shape[-1] ** -0.5, backend=backend,
                                kv_scales=scales)


def _setup(mode: str, storage, t: int = 37, heads: int = 4, kv_heads: int = 2, d: int = 16,
           page_size: int = 8, seed: int = 0):
    rng = np.random.default_rng(seed)
    spread = np.array([0.5, 30.0][:kv_heads])  # heads of very different ranges
    q = rng.standard_normal((t, heads, d)).astype(np.float32)
    k, v = _heads(rng, t, kv_heads, d, spread), _heads(rng, t, kv_heads, d, spread * 0.1)
    scales = None
    if mode in quant.SCALED:
        amax = np.stack([np.abs(k).max(axis=(0, 2)), np.abs(v).max(axis=(0, 2))])  # [2, K]
        layer_scales = quant.scales_from_amax(amax)
        scales = np.ones((2, 2, kv_heads), np.float32)  # [L, 2, K]; layer 0 unused
        scales[LAYER] = layer_scales
    pages = -(-t // page_size)
    pool = jnp.zeros((pages + 3, 2, 2, page_size, kv_heads, d), storage)
    table = (rng.permutation(pages + 2)[:pages] + 1).astype(np.int32)[None]
    return q, k, v, scales, pool, table


@pytest.mark.parametrize(("mode", "dtype", "storage", "mantissa", "min_exp"), MODES)
def test_write_stores_reference_bytes_and_round_trips(mode, dtype, storage, mantissa,
                                                      min_exp):
    q, k, v, scales, pool, table = _setup(mode, storage)
    t = k.shape[0]
    pos, n = np.arange(t)[None], np.array([t])
    _, pool = _write_attend(pool, q[None], k[None], v[None], table, pos, n, n,
                            None if scales is None else jnp.asarray(scales))
    stored = np.asarray(pool)[table[0], LAYER]  # [P, 2, S, K, D]
    stored = stored.transpose(1, 0, 2, 3, 4).reshape(2, -1, *stored.shape[3:])[:, :t]
    for i, x in enumerate((k, v)):
        s = None if scales is None else scales[LAYER, i][None, :, None]
        want = _reference_bytes(x, dtype, s)
        assert stored[i].dtype == storage and np.array_equal(
            stored[i].view(np.uint8), want.view(np.uint8)), f"{mode}: {'KV'[i]} bytes differ"
        back = np.asarray(quant.dequantize(jnp.asarray(stored[i]),
                                           None if s is None else jnp.asarray(s)))
        # round to nearest: half a spacing, relative 2^-(m+1), or half the subnormal step
        unit = 1.0 if s is None else s
        bound = np.maximum(np.abs(x) * 2.0 ** -(mantissa + 1), unit * 2.0 ** (min_exp - 1))
        assert np.all(np.abs(back - x) <= bound * (1 + 1e-6)), f"{mode}: round trip"


def test_out_of_range_values_saturate():
    x = jnp.asarray([[1e6, -1e6, 3.0, 1e30]], jnp.float32)
    for dtype in (E4M3, E5M2):
        y = np.asarray(quant.quantize(x, dtype)).astype(np.float32)
        limit = float(jnp.finfo(dtype).max)
        assert np.isfinite(y).all() and y[0, 0] == limit and y[0, 1] == -limit
    for stand_in in (jnp.uint8, jnp.int8):  # the CPU stand-ins: the same values, as bytes
        y = np.asarray(quant.dequantize(quant.quantize(x, stand_in)))
        limit = float(jnp.finfo(quant.as_float(jnp.zeros(1, stand_in)).dtype).max)
        assert np.isfinite(y).all() and y[0, 0] == limit and y[0, 1] == -limit


# one prefill and 5-token chunks on XLA; the Pallas kernel (interpret mode: slow) once
# (bfloat16 pools on Pallas: its own tests, as any float pool)
@pytest.mark.parametrize(("backend", "chunk", "mode", "dtype", "storage"), [
    (backend, chunk, *m[:3]) for backend, chunk in [("xla", 37), ("xla", 5), ("pallas", 37)]
    for m in MODES if backend == "xla" or m[0] in quant.FP8])
def test_attention_over_fp8_pages_matches_dequantized_reference(backend, chunk, mode, dtype,
                                                                storage):
    q, k, v, scales, pool, table = _setup(mode, storage, seed=chunk)
    t = k.shape[0]
    js = None if scales is None else jnp.asarray(scales)
    outs = []
    for start in range(0, t, chunk):
        n = min(chunk, t - start)
        pos = np.arange(start, start + chunk)[None]
        pad = [(0, chunk - n), (0, 0), (0, 0)]
        q_c, k_c, v_c = (jnp.pad(x[start:start + n], pad)[None] for x in (q, k, v))
        out, pool = _write_attend(pool, q_c, k_c, v_c, table, pos, np.array([start + n]),
                                  np.array([n]), js, backend=backend)
        outs.append(np.asarray(out)[0, :n])
    got = np.concatenate(outs)
    deq = []
    for i, x in enumerate((k, v)):
        s = None if scales is None else scales[LAYER, i][None, :, None]
        deq.append(np.asarray(quant.dequantize(jnp.asarray(_reference_bytes(x, dtype, s)),
                                               None if s is None else jnp.asarray(s))))
    want = attention_xla.dense_causal_attention(jnp.asarray(q), jnp.asarray(deq[0]),
                                                jnp.asarray(deq[1]), q.shape[-1] ** -0.5)
    # folded scales: one more float32 rounding of q and of the output than the reference
    tol = attention_tolerance(q, deq[0], deq[1], scale=q.shape[-1] ** -0.5, context_len=t)
    assert_close(got, want, tol, f"{backend} {mode} chunk {chunk} vs dequantized dense")


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_pallas_fp8_reads_lower_for_triton(dtype):
    """The kernel over an fp8 pool lowers through the Pallas Triton backend (no GPU
    needed; Triton's own compile to PTX runs on a GPU only)."""
    batch, kv_heads, page, head_dim = 2, 2, 16, 64
    q = jax.ShapeDtypeStruct((batch, 1, 2 * kv_heads, head_dim), jnp.bfloat16)
    pool = jax.ShapeDtypeStruct((9, 2, 2, page, kv_heads, head_dim), dtype)
    tables = jax.ShapeDtypeStruct((batch, 4), jnp.int32)
    lens = jax.ShapeDtypeStruct((batch,), jnp.int32)
    scales = jax.ShapeDtypeStruct((2, kv_heads), jnp.float32)

    def fn(q, pool, tables, ctx, qlen, scales):
        return attention_pallas.paged_attention(q, pool, 1, tables, ctx, qlen, scale=0.1,
                                                interpret=False, kv_scales=scales)

    text = jax.jit(fn).trace(q, pool, tables, lens, lens, scales).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text
