"""Paged attention and KV write in plain XLA: the reference every kernel is tested against.

Attention walks the request's pages in blocks with an online softmax, for a dynamic number
of blocks (the longest context in the batch), so the compiled step does not depend on the
context length and a short batch does not pay for the longest possible one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import superinfer_jax.ops.native as native
from superinfer_jax.kv import quant
from superinfer_jax.kv.layout import NULL_PAGE
from superinfer_jax.ops.paging import pad_page_table

_MASKED = -1e30


def write_kv(
    kv_pool: jax.Array,  # [N, L, 2, S, K, D]
    layer: int,
    k: jax.Array,  # [B, C, K, D]
    v: jax.Array,  # [B, C, K, D]
    page_tables: jax.Array,  # [B, P]
    positions: jax.Array,  # [B, C]
    query_lens: jax.Array,  # [B]
    scales: jax.Array | None = None,  # [2, K]: this layer's fp8_e4m3 scales
) -> jax.Array:
    """Scatter the step's new K/V into the pool in place; padding goes to the null page.
    An fp8 pool stores them quantized (``kv.quant.quantize``: divided by ``scales``)."""
    page_size = kv_pool.shape[3]
    cols = jnp.arange(positions.shape[1])[None, :]
    valid = cols < query_lens[:, None]
    page_idx = jnp.clip(positions // page_size, 0, page_tables.shape[1] - 1)
    pages = jnp.take_along_axis(page_tables, page_idx, axis=1)
    pages = jnp.where(valid, pages, NULL_PAGE)
    offsets = positions % page_size
    kv = jnp.stack([k, v], axis=2)  # [B, C, 2, K, D]
    kv = quant.quantize(kv, kv_pool.dtype, None if scales is None else scales[:, :, None])
    return kv_pool.at[pages, layer, :, offsets].set(kv, mode="promise_in_bounds")


def paged_attention(
    q: jax.Array,  # [B, C, H, D]
    kv_pool: jax.Array,  # [N, L, 2, S, K, D]
    layer: int,
    page_tables: jax.Array,  # [B, P]
    context_lens: jax.Array,  # [B]
    query_lens: jax.Array,  # [B]
    *,
    scale: float,
    pages_per_block: int | None = None,
    soft_cap: float | None = None,
    gather_impl: str = "auto",
    kv_scales: jax.Array | None = None,  # [2, K]: this layer's fp8_e4m3 scales
) -> jax.Array:
    """Causal attention of each row's queries over its paged past plus its new tokens.

    Query column ``c`` of row ``b`` sits at position ``context_lens[b] - query_lens[b] + c``
    and sees keys at positions ``<=`` its own. Returns [B, C, H, D] in q's dtype; padded
    rows and columns hold finite garbage. ``pages_per_block``: 4 for decode (fewer
    padding keys past the context), else 8.

    ``gather_impl="auto"``: on CPU the pages are gathered by ``native.gather_kv`` (XLA:CPU's
    gather moves scalars; the bytes are the same), and a float32 decode step without soft
    cap runs ``native.decode_attention`` instead of the block loop (each row over its own
    context; equal to the loop to float32 rounding). ``"xla"``: XLA's everywhere, the
    reference the native ops are tested against. An fp8 pool is read as stored and cast
    (the native decode kernel reads float32 pages only, so fp8 decode takes the loop);
    ``kv_scales`` fold into the queries and the output (``kv.quant``). One function, long
    for a kernel: the gathers and the loop body close over its shapes, so the trace reads
    top to bottom.
    """
    if gather_impl not in ("auto", "xla"):
        raise ValueError(f"gather_impl must be 'auto' or 'xla', got {gather_impl!r}")
    if gather_impl == "auto" and not native.available():
        gather_impl = "xla"
    if (gather_impl == "auto" and q.shape[1] == 1 and soft_cap is None
            and q.dtype == kv_pool.dtype == jnp.float32
            and q.shape[3] in native.DECODE_ATTENTION_HEAD_DIMS
            and native.decode_attention_available()):
        # Decode on CPU: the native kernel, each row over its own context only.
        def native_decode(q, kv_pool, page_tables, context_lens):
            return native.decode_attention(q[:, 0], kv_pool, page_tables, context_lens, layer,
                                           scale)[:, None]

        def xla_decode(q, kv_pool, page_tables, context_lens):
            return paged_attention(q, kv_pool, layer, page_tables, context_lens, query_lens,
                                   scale=scale, pages_per_block=pages_per_block,
                                   soft_cap=soft_cap, gather_impl="xla", kv_scales=kv_scales)

        return jax.lax.platform_dependent(q, kv_pool, page_tables, context_lens,
                                          cpu=native_decode, default=xla_decode)
    batch, cols, num_heads, head_dim = q.shape
    if pages_per_block is None:
        pages_per_block = 4 if cols == 1 else 8
    page_size, num_kv_heads = kv_pool.shape[3], kv_pool.shape[4]
    group = num_heads // num_kv_heads
    num_pages_per_seq = page_tables.shape[1]
    ppb = min(pages_per_block, num_pages_per_seq)
    pad = (-num_pages_per_seq) % ppb
    if pad:
        page_tables = pad_page_table(page_tables, num_pages_per_seq + pad)
    block_tokens = ppb * page_size

    qg = q.reshape(batch, cols, num_kv_heads, group, head_dim).astype(jnp.float32) * scale
    if kv_scales is not None:  # q . (s_k k) = (s_k q) . k, per KV head
        qg = qg * kv_scales[0][None, None, :, None, None]
    qg = qg.transpose(0, 2, 3, 1, 4)  # [B, K, G, C, D]: batch dims first, as the dot wants
    q_pos = (context_lens - query_lens)[:, None] + jnp.arange(cols)[None, :]  # [B, C]
    num_blocks = (jnp.max(context_lens) + block_tokens - 1) // block_tokens
    heads = jnp.arange(num_kv_heads)[None, :, None]  # [1, K, 1]

    def xla_gather(ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        # [B, 1, ppb] pages x [1, K, 1] heads -> [B, K, ppb, S, D]: heads contiguous, so the
        # dots batch over (B, K) with no transpose copy of each gathered block
        return (kv_pool[ids[:, None, :], layer, 0, :, heads],
                kv_pool[ids[:, None, :], layer, 1, :, heads])

    def native_gather(ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        return native.gather_kv(kv_pool, ids, layer)

    def gather(ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        if gather_impl == "xla":
            k, v = xla_gather(ids)
        else:
            k, v = jax.lax.platform_dependent(ids, cpu=native_gather, default=xla_gather)
        shape = (batch, num_kv_heads, block_tokens, head_dim)
        k, v = quant.as_float(k), quant.as_float(v)  # CPU stand-in integers: the float type
        return k.reshape(shape).astype(jnp.float32), v.reshape(shape).astype(jnp.float32)

    def body(i, carry):
        m, denom, acc = carry
        ids = jax.lax.dynamic_slice_in_dim(page_tables, i * ppb, ppb, axis=1)  # [B, ppb]
        k, v = gather(ids)  # [B, K, T, D]
        s = jnp.einsum("bkgcd,bktd->bkgct", qg, k)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        k_pos = i * block_tokens + jnp.arange(block_tokens)
        visible = (k_pos[None, None, :] <= q_pos[:, :, None]) & (
            k_pos[None, None, :] < context_lens[:, None, None]
        )  # [B, C, T]
        s = jnp.where(visible[:, None, None], s, _MASKED)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[..., None])
        correction = jnp.exp(m - m_new)
        denom_new = denom * correction + p.sum(axis=-1)
        pv = jnp.einsum("bkgct,bktd->bkgcd", p, v)
        acc_new = acc * correction[..., None] + pv
        return m_new, denom_new, acc_new

    m0 = jnp.full((batch, num_kv_heads, group, cols), _MASKED, jnp.float32)
    denom0 = jnp.zeros((batch, num_kv_heads, group, cols), jnp.float32)
    acc0 = jnp.zeros((batch, num_kv_heads, group, cols, head_dim), jnp.float32)
    _, denom, acc = jax.lax.fori_loop(0, num_blocks, body, (m0, denom0, acc0))
    out = acc / jnp.maximum(denom, 1e-30)[..., None]  # [B, K, G, C, D]
    if kv_scales is not None:  # sum p (s_v v) = s_v sum p v
        out = out * kv_scales[1][None, :, None, None, None]
    out = out.transpose(0, 3, 1, 2, 4).reshape(batch, cols, num_heads, head_dim)
    return out.astype(q.dtype)


def dense_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, scale: float) -> jax.Array:
    """Plain contiguous causal GQA attention, [T, H, D] x [T, K, D]: the test oracle."""
    t, h, d = q.shape
    kh = k.shape[1]
    qg = q.reshape(t, kh, h // kh, d).astype(jnp.float32) * scale
    s = jnp.einsum("qkgd,tkd->kgqt", qg, k.astype(jnp.float32))
    mask = jnp.tril(jnp.ones((t, t), bool))
    s = jnp.where(mask, s, _MASKED)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("kgqt,tkd->qkgd", p, v.astype(jnp.float32))
    return out.reshape(t, h, d).astype(q.dtype)
