"""The XLA paged reference against a dense contiguous oracle.

The Pallas kernels are tested against ``attention_xla.paged_attention``; this file is why
that reference can be trusted: written through ``write_kv`` into shuffled pages and read
back in one prefill or in chunks, it must equal plain causal attention on the sequence.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from superinfer_jax.ops import attention_xla
from tests.numerics import assert_close, attention_tolerance


@functools.partial(jax.jit, static_argnames=("scale",))
def _step(pool, q, k, v, table, pos, ctx, qlen, *, scale: float):
    """Write one chunk's K/V into layer 1 of the pool, then attend: one compile per shape."""
    pool = attention_xla.write_kv(pool, 1, k, v, table, pos, qlen)
    out = attention_xla.paged_attention(q, pool, 1, table, ctx, qlen, scale=scale,
                                        pages_per_block=2)  # [1, C, H, D]
    return pool, out


def _sequence(rng: np.random.Generator, t: int, h: int, k: int, d: int):
    q = jnp.asarray(rng.standard_normal((t, h, d)), jnp.float32)  # [T, H, D]
    kk = jnp.asarray(rng.standard_normal((t, k, d)), jnp.float32)  # [T, K, D]
    v = jnp.asarray(rng.standard_normal((t, k, d)), jnp.float32)  # [T, K, D]
    return q, kk, v


@pytest.mark.parametrize(
    ("t", "heads", "kv_heads", "page_size", "chunk"),
    [(1, 4, 4, 8, 1), (16, 6, 2, 16, 16), (33, 8, 2, 8, 33), (41, 4, 1, 16, 7)],
)
def test_paged_matches_dense(t: int, heads: int, kv_heads: int, page_size: int, chunk: int):
    rng = np.random.default_rng(t)
    d, scale = 16, 0.25
    q, k, v = _sequence(rng, t, heads, kv_heads, d)
    pages = -(-t // page_size)
    pool = jnp.zeros((pages + 3, 2, 2, page_size, kv_heads, d), jnp.float32)  # [N, L, 2, S, K, D]
    table = (rng.permutation(pages + 2)[:pages] + 1).astype(np.int32)[None, :]  # [1, P]
    outs = []
    for start in range(0, t, chunk):
        n = min(chunk, t - start)
        pos = np.arange(start, start + chunk)[None, :]  # [1, C] (tail padded)
        qlen, ctx = np.array([n]), np.array([start + n])

        def pad(x, start=start, n=n):  # [T, ., D] -> [1, C, ., D]
            return jnp.pad(x[start:start + n], ((0, chunk - n), (0, 0), (0, 0)))[None]

        pool, out = _step(pool, pad(q), pad(k), pad(v), table, pos, ctx, qlen, scale=scale)
        outs.append(out[0, :n])
    got = jnp.concatenate(outs)  # [T, H, D]
    want = attention_xla.dense_causal_attention(q, k, v, scale)  # [T, H, D]
    # Blocked online softmax over pages vs one dense softmax: other summation orders,
    # bounded by head dim, context and the inputs' sizes (tests/numerics).
    tol = attention_tolerance(q, k, v, scale=scale, context_len=t)
    assert_close(got, want, tol, f"paged vs dense, t={t}, chunk={chunk}")
