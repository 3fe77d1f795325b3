"""The native decode attention (``ops/native/decode_attention.cc``) against XLA's paged
block loop (``gather_impl="xla"``), within the float32 attention bound; each row's bits
independent of its batch; used by ``paged_attention`` for one query column on CPU only."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from superinfer_jax.ops import attention_xla, native
from tests.numerics import assert_close, attention_tolerance

pytestmark = pytest.mark.skipif(
    not native.decode_attention_available(),
    reason="this CPU lacks AVX-512F (or no C++ compiler): XLA's block loop is used")


def _case(rng, batch, heads, kv_heads, head_dim, page_size, pages, num_pages=40, layers=2):
    pool = jnp.asarray(rng.standard_normal((num_pages, layers, 2, page_size, kv_heads, head_dim)),
                       jnp.float32)
    q = jnp.asarray(rng.standard_normal((batch, 1, heads, head_dim)), jnp.float32)
    tables = jnp.asarray(rng.integers(0, num_pages, (batch, pages)), jnp.int32)
    return q, pool, tables


def _native(q, pool, tables, lens, layer, scale):
    call = jax.jit(native.decode_attention, static_argnums=(4, 5))
    return call(q[:, 0], pool, tables, lens, layer, scale)


# (heads, kv heads, head dim, page size, pages per row): SmolLM2's 9/3/64 with pages of
# 16; pages shorter than the 16-token chunk (8) and not dividing it (6); one KV head per
# query head; head dims 16 and 128.
@pytest.mark.parametrize("heads,kv_heads,head_dim,page_size,pages",
                         [(9, 3, 64, 16, 12), (4, 2, 16, 8, 5), (6, 2, 32, 6, 7),
                          (8, 8, 128, 16, 3), (2, 1, 256, 16, 2)])
def test_matches_the_block_loop(heads, kv_heads, head_dim, page_size, pages) -> None:
    rng = np.random.default_rng(heads * 100 + page_size)
    batch = 6
    q, pool, tables = _case(rng, batch, heads, kv_heads, head_dim, page_size, pages)
    # Every row's context: one token, a page boundary, a partial page, the whole table.
    lens = jnp.asarray([1, page_size, page_size + 3, pages * page_size, 2, pages * page_size - 1],
                       jnp.int32)
    scale = head_dim**-0.5
    got = _native(q, pool, tables, lens, 1, scale)
    want = attention_xla.paged_attention(q, pool, 1, tables, lens, jnp.ones(batch, jnp.int32),
                                         scale=scale, gather_impl="xla")[:, 0]
    assert got.shape == want.shape == (batch, heads, head_dim)
    tol = attention_tolerance(q, pool[:, 1, 0], pool[:, 1, 1], scale=scale,
                              context_len=pages * page_size)
    assert_close(got, want, tol, f"native decode vs block loop, {heads}/{kv_heads}x{head_dim}")


def test_a_rows_bits_do_not_depend_on_its_batch() -> None:
    rng = np.random.default_rng(7)
    q, pool, tables = _case(rng, 9, 9, 3, 64, 16, 6)
    lens = jnp.asarray(rng.integers(1, 97, 9), jnp.int32)
    full = np.asarray(_native(q, pool, tables, lens, 0, 0.125))
    for b in (0, 4, 8):
        alone = _native(q[b:b + 1], pool, tables[b:b + 1], lens[b:b + 1], 0, 0.125)
        np.testing.assert_array_equal(np.asarray(alone)[0], full[b])


def test_no_context_gives_zeros_and_bad_ids_are_clamped() -> None:
    rng = np.random.default_rng(8)
    q, pool, _ = _case(rng, 2, 4, 2, 16, 8, 3, num_pages=5)
    tables = jnp.asarray([[-4, 2, 99], [0, 1, 2]], jnp.int32)
    lens = jnp.asarray([20, 0], jnp.int32)
    got = np.asarray(_native(q, pool, tables, lens, 0, 0.25))
    assert np.all(got[1] == 0)
    want = attention_xla.paged_attention(q[:1], pool, 0, jnp.clip(tables[:1], 0, 4), lens[:1],
                                         jnp.ones(1, jnp.int32), scale=0.25,
                                         gather_impl="xla")[:, 0]
    tol = attention_tolerance(q, pool[:, 0, 0], pool[:, 0, 1], scale=0.25, context_len=20)
    assert_close(got[:1], want, tol, "clamped page ids")


def test_paged_attention_uses_it_for_decode_on_cpu_only() -> None:
    rng = np.random.default_rng(9)
    q, pool, tables = _case(rng, 2, 4, 2, 16, 8, 3)
    lens, qlens = jnp.asarray([5, 17], jnp.int32), jnp.ones(2, jnp.int32)

    def attend(q, pool):
        return attention_xla.paged_attention(q, pool, 0, tables, lens, qlens, scale=0.25)

    step = jax.jit(attend)
    assert native.DECODE_ATTENTION_TARGET in step.lower(q, pool).as_text()
    # Through the wrapper (layer, scale, the query column) the values are the loop's.
    want = attention_xla.paged_attention(q, pool, 0, tables, lens, qlens, scale=0.25,
                                         gather_impl="xla")
    got = step(q, pool)
    assert got.shape == want.shape == q.shape
    tol = attention_tolerance(q, pool[:, 0, 0], pool[:, 0, 1], scale=0.25, context_len=24)
    assert_close(got, want, tol, "paged_attention's native decode vs its block loop")
    cuda = step.trace(q, pool).lower(lowering_platforms=("cuda",)).as_text()
    assert native.DECODE_ATTENTION_TARGET not in cuda
    # Prefill (several query columns) keeps the block loop.
    q2 = jnp.concatenate([q, q], axis=1)
    prefill = jax.jit(lambda q, pool: attention_xla.paged_attention(
        q, pool, 0, tables, lens, 2 * qlens, scale=0.25))
    assert native.DECODE_ATTENTION_TARGET not in prefill.lower(q2, pool).as_text()


def test_bad_operands_name_the_problem() -> None:
    rng = np.random.default_rng(10)
    q, pool, tables = _case(rng, 1, 4, 2, 16, 8, 2)
    lens = jnp.asarray([3], jnp.int32)
    with pytest.raises(ValueError, match="must be float32"):
        native.decode_attention(q[:, 0].astype(jnp.bfloat16), pool, tables, lens, 0, 1.0)
    with pytest.raises(ValueError, match="do not match"):
        native.decode_attention(q[:, 0], pool, tables, lens, 5, 1.0)
    odd = jnp.zeros((1, 4, 48), jnp.float32)
    with pytest.raises(ValueError, match="do not match|head_dim"):
        native.decode_attention(odd, pool, tables, lens, 0, 1.0)
