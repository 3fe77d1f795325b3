"""Pallas paged attention (interpret mode on CPU) against the XLA reference.

Interpret mode runs every grid step as an XLA loop iteration, so shapes stay small and the
issue's matrix (batch 1-16; 1, 3, 4, 8 query heads per KV head; head dim 64/128; pages of
8/16/32; lengths 1, a page, a page plus one, long; shuffled tables; mixed prefill and decode
rows; float32 and bfloat16) is covered by chosen cases rather than the full product.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from superinfer_jax import ops
from superinfer_jax.ops import attention_pallas, attention_xla
from tests.numerics import assert_close, attention_tolerance

LAYER, NUM_LAYERS = 1, 2


@dataclass(frozen=True)
class Case:
    ctx: tuple[int, ...]  # context length per row (past + new)
    qlen: tuple[int, ...]  # new tokens per row (1 = decode, 0 = padding row)
    group: int  # query heads per KV head
    head_dim: int
    page_size: int
    kv_heads: int = 2
    dtype: str = "float32"
    soft_cap: float | None = None


def _inputs(case: Case, seed: int = 0):
    """Random pool with a shuffled, non-contiguous page table per row (unused slots: null)."""
    rng = np.random.default_rng(seed)
    batch, cols = len(case.ctx), max(max(case.qlen), 1)
    per_row = max(-(-max(case.ctx) // case.page_size), 1) + 1  # one spare slot per table
    num_pages = batch * per_row + 1
    shape = (num_pages, NUM_LAYERS, 2, case.page_size, case.kv_heads, case.head_dim)
    pool = jnp.asarray(rng.standard_normal(shape), case.dtype)  # [N, L, 2, S, K, D]
    ids = rng.permutation(np.arange(1, num_pages)).reshape(batch, per_row)
    used = np.arange(per_row)[None, :] < -(-np.asarray(case.ctx)[:, None] // case.page_size)
    tables = np.where(used, ids, 0).astype(np.int32)  # [B, P]
    heads = case.group * case.kv_heads
    q = jnp.asarray(rng.standard_normal((batch, cols, heads, case.head_dim)),
                    case.dtype)  # [B, C, H, D]
    ctx = np.asarray(case.ctx, np.int32)  # [B]
    qlen = np.asarray(case.qlen, np.int32)  # [B]
    return q, pool, tables, ctx, qlen


@functools.partial(jax.jit, static_argnames=("fn", "soft_cap", "kwargs"))
def _run(fn, q, pool, tables, ctx, qlen, soft_cap, kwargs=()):
    return fn(q, pool, LAYER, tables, ctx, qlen, scale=q.shape[-1] ** -0.5, soft_cap=soft_cap,
              **dict(kwargs))


def _check(case: Case, fn=attention_pallas.paged_attention, **kwargs) -> None:
    q, pool, tables, ctx, qlen = _inputs(case)
    got = np.asarray(_run(fn, q, pool, tables, ctx, qlen, case.soft_cap,
                          tuple(sorted(kwargs.items()))), np.float32)  # [B, C, H, D]
    want = np.asarray(_run(attention_xla.paged_attention, q, pool, tables, ctx, qlen,
                           case.soft_cap), np.float32)  # [B, C, H, D]
    assert got.shape == want.shape and np.isfinite(got).all()
    # Kernel and reference walk the keys in other tiles with other online-softmax steps,
    # and XLA:CPU sums each in its own order per CPU: a bound from the inputs' sizes,
    # head dim and context (float32), plus bfloat16's roundings (tests/numerics).
    pool_np = np.asarray(pool[:, LAYER], np.float32)  # [N, 2, S, K, D]
    for b, n in enumerate(case.qlen):
        if n == 0:
            continue  # a padding row's output is unspecified
        tol = attention_tolerance(np.asarray(q[b, :n], np.float32), pool_np[:, 0],
                                  pool_np[:, 1], scale=case.head_dim ** -0.5,
                                  context_len=case.ctx[b], dtype=case.dtype,
                                  out=want[b, :n])
        assert_close(got[b, :n], want[b, :n], tol,
                     f"row {b} (ctx {case.ctx[b]}, qlen {n}, {case.dtype})")


DECODE = {
    "b1-g1-len1": Case(ctx=(1,), qlen=(1,), group=1, head_dim=64, page_size=8),
    "page-edges-g3-d128": Case(ctx=(1, 16, 17, 70), qlen=(1,) * 4, group=3, head_dim=128,
                               page_size=16),
    "b16-g4": Case(ctx=tuple(range(1, 65, 4)), qlen=(1,) * 16, group=4, head_dim=64,
                   page_size=8),
    "g8-page32-bf16": Case(ctx=(32, 33, 100), qlen=(1,) * 3, group=8, head_dim=64,
                           page_size=32, dtype="bfloat16"),
    "softcap-padding-row": Case(ctx=(9, 0, 40), qlen=(1, 0, 1), group=4, head_dim=64,
                                page_size=8, soft_cap=5.0),
    "g3-d128-bf16-long": Case(ctx=(150, 2), qlen=(1, 1), group=3, head_dim=128, page_size=16,
                              kv_heads=1, dtype="bfloat16"),
}

PREFILL = {
    "mixed-g3-page8": Case(ctx=(8, 17, 33), qlen=(8, 5, 1), group=3, head_dim=64,
                           page_size=8),
    "mixed-g8-d128-bf16": Case(ctx=(16, 40, 7, 0), qlen=(16, 9, 1, 0), group=8, head_dim=128,
                               page_size=16, dtype="bfloat16"),
    "g1-page32-edges": Case(ctx=(32, 33), qlen=(5, 2), group=1, head_dim=64, page_size=32),
    "g4-softcap-bf16": Case(ctx=(24, 70), qlen=(6, 3), group=4, head_dim=64, page_size=16,
                            dtype="bfloat16", soft_cap=8.0),
}


@pytest.mark.parametrize("case", DECODE.values(), ids=DECODE.keys())
def test_decode_matches_xla(case: Case):
    _check(case)


@pytest.mark.parametrize("case", PREFILL.values(), ids=PREFILL.keys())
def test_prefill_matches_xla(case: Case):
    _check(case)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_split_kv_combines(num_splits: int):
    """Flash-decoding: several splits per row, several tiles per split, some splits empty."""
    case = Case(ctx=(1, 50, 95), qlen=(1, 1, 1), group=4, head_dim=64, page_size=8)
    _check(case, attention_pallas.decode_attention, num_splits=num_splits, block_tokens=16)


def test_prefill_row_blocks_skip_padding():
    """Many row blocks per request: later blocks of short rows are padding and skipped."""
    case = Case(ctx=(30, 12, 5), qlen=(12, 12, 1), group=3, head_dim=64, page_size=8)
    _check(case, attention_pallas.prefill_attention, block_rows=16, block_tokens=16)


def test_matches_dense_oracle():
    """One contiguous prefill through shuffled pages equals plain causal attention."""
    rng = np.random.default_rng(3)
    t, heads, kv_heads, d, page = 21, 4, 2, 64, 8
    q = jnp.asarray(rng.standard_normal((t, heads, d)), jnp.float32)  # [T, H, D]
    k = jnp.asarray(rng.standard_normal((t, kv_heads, d)), jnp.float32)  # [T, K, D]
    v = jnp.asarray(rng.standard_normal((t, kv_heads, d)), jnp.float32)  # [T, K, D]
    pool = jnp.zeros((6, 1, 2, page, kv_heads, d), jnp.float32)  # [N, L, 2, S, K, D]
    table = np.array([[4, 2, 5]], np.int32)  # [1, P]
    pos, lens = np.arange(t)[None, :], np.array([t], np.int32)  # [1, T], [1]
    pool = attention_xla.write_kv(pool, 0, k[None], v[None], table, pos, lens)
    got = attention_pallas.paged_attention(q[None], pool, 0, table, lens, lens,
                                           scale=d**-0.5)  # [1, T, H, D]
    want = attention_xla.dense_causal_attention(q, k, v, d**-0.5)  # [T, H, D]
    # Tiled online softmax vs one dense softmax: float32 bound of tests/numerics.
    tol = attention_tolerance(q, k, v, scale=d**-0.5, context_len=t)
    assert_close(got[0], want, tol, "Pallas vs dense oracle")


def test_backend_switch_dispatches_to_pallas():
    case = Case(ctx=(5, 9), qlen=(1, 1), group=1, head_dim=64, page_size=8)
    q, pool, tables, ctx, qlen = _inputs(case)
    got = ops.paged_attention(q, pool, LAYER, tables, ctx, qlen, scale=0.125, backend="pallas")
    want = ops.paged_attention(q, pool, LAYER, tables, ctx, qlen, scale=0.125, backend="xla")
    # Both backends over the same pages: the float32 bound of tests/numerics.
    kv = np.asarray(pool[:, LAYER])  # [N, 2, S, K, D]
    tol = attention_tolerance(q, kv[:, 0], kv[:, 1], scale=0.125, context_len=max(case.ctx))
    assert_close(got, want, tol, "backend='pallas' vs backend='xla'")
    assert attention_pallas.default_interpret() == (jax.default_backend() != "gpu")


@pytest.mark.parametrize(("cols", "group", "head_dim", "dtype"),
                         [(1, 5, 128, "bfloat16"), (12, 3, 64, "float32")])
def test_lowers_for_triton(cols: int, group: int, head_dim: int, dtype: str):
    """The kernel lowers through the Pallas Triton backend (sm_90 fallback, no GPU needed).

    This runs every Pallas-to-Triton-IR lowering rule the kernel needs; Triton's own
    compilation to PTX happens inside XLA:GPU and is only exercised on a GPU.
    """
    batch, kv_heads, page = 2, 2, 16
    q = jax.ShapeDtypeStruct((batch, cols, group * kv_heads, head_dim), dtype)
    pool = jax.ShapeDtypeStruct((9, 2, 2, page, kv_heads, head_dim), dtype)
    tables = jax.ShapeDtypeStruct((batch, 4), jnp.int32)
    lens = jax.ShapeDtypeStruct((batch,), jnp.int32)

    def fn(q, pool, tables, ctx, qlen):
        return attention_pallas.paged_attention(q, pool, 1, tables, ctx, qlen, scale=0.1,
                                                soft_cap=30.0, interpret=False)

    text = jax.jit(fn).trace(q, pool, tables, lens, lens).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text
