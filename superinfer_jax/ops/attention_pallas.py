"""Pallas paged attention over the KV page pool: one kernel body, a decode and a prefill grid.

Why our own kernel: JAX ships no maintained GPU paged-attention kernel for our layout (the
Pallas Triton ops use a head-major ``[K, pages, S, D]`` pool; the TPU ragged kernel does
not interpret on CPU). This one reads the block-first pool ``[N, L, 2, S, K, D]`` in place
and lowers through the Pallas Triton backend; elsewhere it runs in interpret mode, which
is how CI tests it (``test_cuda_lowering.py`` also lowers the engine step for CUDA).

Query heads are grouped by KV head (GQA): row ``c * G + g`` of the ``[B, K, C * G, D]``
query matrix is query column ``c``, head ``kh * G + g``, so one program's K/V tile feeds
every query head sharing it. Rows are padded to a power of two >= 16 (Triton's ``dot``).
- Decode (``C == 1``): grid ``(B, K, 1, num_splits)``; each program walks its slice of the
  KV length (flash-decoding) and an XLA epilogue combines the splits' partial outputs.
- Ragged prefill (``C > 1``): grid ``(B, K, R, 1)`` over ``R`` row blocks; a block past
  the row's ``query_lens`` does no work, a live one reads keys up to its last query.
K/V are read token by token through the page table (a ``[T, D]`` load with integer
indexers, a pointer gather in Triton), so tiles are independent of the page size.

The pin: Pallas's Triton backend is deprecated from JAX 0.11, so ``pyproject.toml`` pins
``jax<0.11`` until the kernel moves to Pallas Mosaic GPU on Hopper (TMA copies one tile
per page id, which the block-first layout allows, and ``wgmma`` dots). The KV write
stays the XLA scatter ``attention_xla.write_kv``: it moves ``B * C`` tokens a step, and
fusing it would need a grid-wide barrier.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from superinfer_jax.kv import quant
from superinfer_jax.ops.paging import ceil_div, pad_page_table

_MASKED = -1e30  # same finite "minus infinity" as the XLA reference: no inf - inf NaNs
_MIN_DOT = 16  # Triton dot operands want power-of-two dims >= 16
_TARGET_PROGRAMS = 512  # decode: enough programs to fill ~132 SMs a few times over
_MIN_BLOCKS_PER_SPLIT = 4  # decode: a split shorter than this costs more than it saves


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def default_interpret() -> bool:
    """Interpret mode everywhere except GPU, where the Triton backend compiles the kernel."""
    return jax.default_backend() != "gpu"


def _resolve_interpret(interpret: bool | None) -> bool:
    """``None`` (every entry point's default) means ``default_interpret()``."""
    return default_interpret() if interpret is None else interpret


def _kernel(
    ctx_ref,  # [B] int32: KV length after this step
    qlen_ref,  # [B] int32: new tokens in the row
    pt_ref,  # [B, Pp] int32: page table, padded to cover every tile
    q_ref,  # [BR, D]: block of rows of the [B, K, Rp, D] grouped queries
    pool_ref,  # [N, L, 2, S, K, D]: the whole pool, never blocked
    o_ref,  # [BR, D]: block of the [B, K, NS, Rp, D] partial outputs
    lse_ref,  # [BR] f32: block of the [B, K, NS, Rp] log-sum-exp of each partial
    *,
    layer: int,
    group: int,
    block_tokens: int,
    blocks_per_split: int,
    scale: float,
    soft_cap: float | None,
):
    """Online-softmax attention of one row block over one split of its row's keys."""
    b, kh, r, split = (pl.program_id(i) for i in range(4))
    block_rows = q_ref.shape[0]
    page_size = pool_ref.shape[3]
    ctx, qlen = ctx_ref[b], qlen_ref[b]
    q_start = ctx - qlen  # position of query column 0
    first_col = lax.div(r * block_rows, group)
    last_col = jnp.minimum(lax.div(r * block_rows + block_rows - 1, group), qlen - 1)
    kv_end = jnp.minimum(ctx, q_start + last_col + 1)  # keys this block can see: [0, kv_end)
    split_start = split * (blocks_per_split * block_tokens)
    todo = jnp.maximum(kv_end - split_start, 0)
    n_blocks = jnp.minimum(lax.div(todo + block_tokens - 1, block_tokens), blocks_per_split)
    n_blocks = jnp.where(first_col < qlen, n_blocks, 0)  # padded row block: no work

    rows = r * block_rows + lax.iota(jnp.int32, block_rows)  # [BR]
    q_pos = q_start + lax.div(rows, group)  # [BR]
    q = q_ref[...]  # [BR, D]

    def body(i, carry):
        m, denom, acc = carry  # [BR], [BR], [BR, D] f32
        tok = split_start + i * block_tokens + lax.iota(jnp.int32, block_tokens)  # [T]
        pages = pt_ref[b, lax.div(tok, page_size)]  # [T]
        offs = lax.rem(tok, page_size)  # [T]
        k = quant.as_float(pool_ref[pages, layer, 0, offs, kh, :])  # [T, D]
        v = quant.as_float(pool_ref[pages, layer, 1, offs, kh, :])  # [T, D]
        if jnp.dtype(v.dtype).itemsize == 1:  # fp8 pages: the dot takes the query's dtype
            v = v.astype(q.dtype)
        s = lax.dot_general(q, k.astype(q.dtype), (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * scale  # [BR, T]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        visible = (tok[None, :] <= q_pos[:, None]) & (tok[None, :] < ctx)  # [BR, T]
        s = jnp.where(visible, s, _MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))  # [BR]
        p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)  # [BR, T]
        correction = jnp.exp(m - m_new)  # [BR]
        denom_new = denom * correction + jnp.sum(p, axis=1)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)  # [BR, D]
        return m_new, denom_new, acc * correction[:, None] + pv

    m0 = jnp.full((block_rows,), _MASKED, jnp.float32)  # [BR]
    denom0 = jnp.zeros((block_rows,), jnp.float32)  # [BR]
    acc0 = jnp.zeros(q.shape, jnp.float32)  # [BR, D]
    m, denom, acc = lax.fori_loop(0, n_blocks, body, (m0, denom0, acc0))
    seen = denom > 0.0  # [BR]: rows with no visible key here (padding, empty split) output 0
    denom = jnp.where(seen, denom, 1.0)
    o_ref[...] = (acc / denom[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log(denom), _MASKED)


def _group_queries(q: jax.Array, num_kv_heads: int, rows_padded: int) -> jax.Array:
    """[B, C, H, D] -> [B, K, Rp, D] with row ``c * G + g``; padding rows are zero."""
    batch, cols, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    qg = q.reshape(batch, cols, num_kv_heads, group, head_dim)  # [B, C, K, G, D]
    qg = qg.transpose(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, cols * group, head_dim)
    return jnp.pad(qg, ((0, 0), (0, 0), (0, rows_padded - cols * group), (0, 0)))


def _ungroup(out: jax.Array, cols: int, group: int) -> jax.Array:
    """[B, K, Rp, D] -> [B, C, H, D], dropping the padding rows."""
    batch, num_kv_heads, _, head_dim = out.shape
    out = out[:, :, : cols * group].reshape(batch, num_kv_heads, cols, group, head_dim)
    return out.transpose(0, 2, 1, 3, 4).reshape(batch, cols, num_kv_heads * group, head_dim)


def _combine_splits(o: jax.Array, lse: jax.Array, dtype) -> jax.Array:
    """Flash-decoding epilogue: weight each split's normalised output by its softmax mass."""
    # o: [B, K, NS, Rp, D], lse: [B, K, NS, Rp]
    top = jnp.max(lse, axis=2, keepdims=True)  # [B, K, 1, Rp]
    w = jnp.exp(lse - top)  # [B, K, NS, Rp]
    out = jnp.sum(o.astype(jnp.float32) * w[..., None], axis=2)  # [B, K, Rp, D]
    return (out / jnp.sum(w, axis=2)[..., None]).astype(dtype)


def _decode_splits(batch: int, num_kv_heads: int, max_blocks: int) -> int:
    """Split the KV length until the grid has about ``_TARGET_PROGRAMS`` programs."""
    want = ceil_div(_TARGET_PROGRAMS, batch * num_kv_heads)
    most = max(1, max_blocks // _MIN_BLOCKS_PER_SPLIT)
    return max(1, min(want, most))


def _dot_dim(n: int) -> int:
    """Round a tile dim up to what Triton's ``dot`` takes: a power of two, at least 16."""
    return max(_MIN_DOT, _next_pow2(n))


@dataclass(frozen=True)
class _Launch:
    """Tiling and Triton options of one launch, rounded in one place for both grids."""

    block_rows: int
    block_tokens: int
    num_splits: int
    num_warps: int
    num_stages: int
    interpret: bool


def _launch(
    *,
    block_rows: int,
    block_tokens: int,
    num_splits: int,
    num_warps: int,
    num_stages: int,
    interpret: bool | None,
) -> _Launch:
    """Round the tile dims for ``dot`` and resolve ``interpret=None`` to the backend default."""
    return _Launch(
        block_rows=_dot_dim(block_rows), block_tokens=_dot_dim(block_tokens),
        num_splits=num_splits, num_warps=num_warps, num_stages=num_stages,
        interpret=_resolve_interpret(interpret),
    )


def _paged_call(
    q: jax.Array,  # [B, C, H, D]
    kv_pool: jax.Array,  # [N, L, 2, S, K, D]
    layer: int,
    page_tables: jax.Array,  # [B, P]
    context_lens: jax.Array,  # [B]
    query_lens: jax.Array,  # [B]
    *,
    scale: float,
    soft_cap: float | None,
    launch: _Launch,
) -> jax.Array:
    """Run the kernel over grid ``(B, K, row blocks, num_splits)`` and assemble [B, C, H, D]."""
    _, cols, num_heads, _ = q.shape
    page_size, num_kv_heads = kv_pool.shape[3], kv_pool.shape[4]
    group = num_heads // num_kv_heads
    row_blocks = ceil_div(cols * group, launch.block_rows)
    max_tokens = page_tables.shape[1] * page_size
    blocks_per_split = ceil_div(max_tokens, launch.block_tokens * launch.num_splits)
    covered_pages = ceil_div(launch.num_splits * blocks_per_split * launch.block_tokens,
                             page_size)
    page_tables = pad_page_table(page_tables.astype(jnp.int32), covered_pages)  # [B, Pp]
    qg = _group_queries(q, num_kv_heads, row_blocks * launch.block_rows)  # [B, K, Rp, D]
    kernel = functools.partial(
        _kernel, layer=layer, group=group, block_tokens=launch.block_tokens,
        blocks_per_split=blocks_per_split, scale=float(scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
    )
    o, lse = _grid_call(kernel, qg, launch)(
        context_lens.astype(jnp.int32), query_lens.astype(jnp.int32), page_tables, qg, kv_pool)
    if launch.num_splits == 1:
        out = o[:, :, 0]  # [B, K, Rp, D]
    else:
        out = _combine_splits(o, lse, q.dtype)  # [B, K, Rp, D]
    return _ungroup(out, cols, group)


def _grid_call(kernel: Callable[..., None], qg: jax.Array, launch: _Launch) -> Callable[..., Any]:
    """The ``pallas_call`` over grid ``(B, K, Rp / block_rows, num_splits)``: partial
    outputs [B, K, NS, Rp, D] (q's dtype for one split, else float32) and their LSE."""
    batch, num_kv_heads, rows_padded, head_dim = qg.shape
    block_rows, num_splits = launch.block_rows, launch.num_splits
    partial_dtype = qg.dtype if num_splits == 1 else jnp.float32
    whole = pl.BlockSpec()  # the full array: indexed inside the kernel, never blocked
    return pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, rows_padded // block_rows, num_splits),
        in_specs=[
            whole, whole, whole,
            pl.BlockSpec((None, None, block_rows, head_dim), lambda b, h, r, s: (b, h, r, 0)),
            whole,
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, block_rows, head_dim),
                         lambda b, h, r, s: (b, h, s, r, 0)),
            pl.BlockSpec((None, None, None, block_rows), lambda b, h, r, s: (b, h, s, r)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, rows_padded, head_dim),
                                 partial_dtype),  # [B, K, NS, Rp, D]
            jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, rows_padded),
                                 jnp.float32),  # [B, K, NS, Rp]
        ],
        interpret=launch.interpret,
        compiler_params=plgpu.CompilerParams(num_warps=launch.num_warps,
                                             num_stages=launch.num_stages),
        name=f"paged_attention_r{block_rows}_t{launch.block_tokens}_s{num_splits}",
    )


def decode_attention(
    q: jax.Array,  # [B, 1, H, D]
    kv_pool: jax.Array,  # [N, L, 2, S, K, D]
    layer: int,
    page_tables: jax.Array,  # [B, P]
    context_lens: jax.Array,  # [B]
    query_lens: jax.Array,  # [B]
    *,
    scale: float,
    soft_cap: float | None = None,
    block_tokens: int = 64,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool | None = None,
) -> jax.Array:
    """One query token per row; KV length split ``num_splits`` ways (default: heuristic)."""
    batch, _, num_heads, _ = q.shape
    num_kv_heads = kv_pool.shape[4]
    block_tokens = _dot_dim(block_tokens)
    max_blocks = ceil_div(page_tables.shape[1] * kv_pool.shape[3], block_tokens)
    if num_splits is None:
        num_splits = _decode_splits(batch, num_kv_heads, max_blocks)
    launch = _launch(block_rows=num_heads // num_kv_heads, block_tokens=block_tokens,
                     num_splits=max(1, min(num_splits, max_blocks)), num_warps=num_warps,
                     num_stages=num_stages, interpret=interpret)
    return _paged_call(q, kv_pool, layer, page_tables, context_lens, query_lens,
                       scale=scale, soft_cap=soft_cap, launch=launch)


def prefill_attention(
    q: jax.Array,  # [B, C, H, D]
    kv_pool: jax.Array,  # [N, L, 2, S, K, D]
    layer: int,
    page_tables: jax.Array,  # [B, P]
    context_lens: jax.Array,  # [B]
    query_lens: jax.Array,  # [B]
    *,
    scale: float,
    soft_cap: float | None = None,
    block_rows: int = 64,
    block_tokens: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool | None = None,
) -> jax.Array:
    """Padded-ragged prefill chunks (and decode rows) in one batch; row blocks skip padding."""
    rows = q.shape[1] * (q.shape[2] // kv_pool.shape[4])
    # No taller than the rows there are: a short chunk does not pay for a 64-row block.
    launch = _launch(block_rows=min(block_rows, rows), block_tokens=block_tokens, num_splits=1,
                     num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    return _paged_call(q, kv_pool, layer, page_tables, context_lens, query_lens,
                       scale=scale, soft_cap=soft_cap, launch=launch)


def paged_attention(
    q: jax.Array,  # [B, C, H, D]
    kv_pool: jax.Array,  # [N, L, 2, S, K, D]
    layer: int,
    page_tables: jax.Array,  # [B, P]
    context_lens: jax.Array,  # [B]
    query_lens: jax.Array,  # [B]
    *,
    scale: float,
    soft_cap: float | None = None,
    interpret: bool | None = None,
    kv_scales: jax.Array | None = None,  # [2, K]: this layer's fp8_e4m3 scales
) -> jax.Array:
    """Same contract as ``attention_xla.paged_attention``; decode grid when ``C == 1``.
    fp8 pages are cast to the query's dtype in the kernel; ``kv_scales`` fold into a
    float32 query and the output outside it (``kv.quant``), so the kernel never scales."""
    if q.shape[2] % kv_pool.shape[4]:
        raise ValueError(f"{q.shape[2]} query heads do not group over {kv_pool.shape[4]}")
    interpret = _resolve_interpret(interpret)
    if not interpret and not math.log2(q.shape[3]).is_integer():
        raise ValueError(f"the Triton kernel needs a power-of-two head_dim, got {q.shape[3]}; "
                         "use attention_backend='xla' for this model")
    fn = decode_attention if q.shape[1] == 1 else prefill_attention
    if kv_scales is None:
        return fn(q, kv_pool, layer, page_tables, context_lens, query_lens, scale=scale,
                  soft_cap=soft_cap, interpret=interpret)
    group = q.shape[2] // kv_pool.shape[4]
    k_scale, v_scale = (jnp.repeat(s, group)[None, None, :, None] for s in kv_scales)  # per H
    out = fn(q.astype(jnp.float32) * k_scale, kv_pool, layer, page_tables, context_lens,
             query_lens, scale=scale, soft_cap=soft_cap, interpret=interpret)
    return (out * v_scale).astype(q.dtype)
