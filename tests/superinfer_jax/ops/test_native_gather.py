"""The native KV gather (a C++ XLA FFI custom call) against XLA's own gather, byte for byte,
and the attention that uses it against the attention that does not."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from superinfer_jax.ops import attention_xla, native

pytestmark = pytest.mark.skipif(
    not native.available(),
    reason="no C++ compiler here: the native gather is optional, XLA's gather is used",
)


def _pool(rng, num_pages=11, layers=3, page_size=4, kv_heads=3, head_dim=8, dtype=np.float32):
    shape = (num_pages, layers, 2, page_size, kv_heads, head_dim)
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def _reference(pool, ids, layer):
    heads = jnp.arange(pool.shape[4])[None, :, None]
    return (pool[ids[:, None, :], layer, 0, :, heads], pool[ids[:, None, :], layer, 1, :, heads])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("batch,pages", [(1, 1), (5, 3), (32, 4)])
def test_gather_is_byte_exact(dtype, batch, pages):
    rng = np.random.default_rng(batch * 10 + pages)
    pool = _pool(rng, dtype=dtype)
    ids = jnp.asarray(rng.integers(0, pool.shape[0], (batch, pages)), jnp.int32)
    for layer in range(pool.shape[1]):
        got = jax.jit(native.gather_kv, static_argnums=2)(pool, ids, layer)
        want = _reference(pool, ids, layer)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape
            np.testing.assert_array_equal(np.asarray(g).view(np.uint8),
                                          np.asarray(w).view(np.uint8))


def test_out_of_range_ids_are_clamped_not_read_past_the_pool():
    rng = np.random.default_rng(1)
    pool = _pool(rng)
    ids = jnp.asarray([[-3, 0, 10, 99]], jnp.int32)
    got = jax.jit(native.gather_kv, static_argnums=2)(pool, ids, 1)
    want = _reference(pool, jnp.clip(ids, 0, pool.shape[0] - 1), 1)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_bad_layer_is_a_value_error():
    pool = _pool(np.random.default_rng(2))
    with pytest.raises(ValueError, match="layer"):
        native.gather_kv(pool, jnp.zeros((1, 1), jnp.int32), 3)


@pytest.mark.parametrize("cols", [1, 5])
def test_attention_with_native_gather_equals_xla_gather_bitwise(cols):
    """The gather moves bytes only, so the attention around it gives identical bits."""
    rng = np.random.default_rng(cols)
    pool = _pool(rng, num_pages=40, page_size=4, kv_heads=2, head_dim=8)
    batch, heads = 3, 4
    tables = jnp.asarray(rng.permutation(np.arange(1, 40))[:batch * 9].reshape(batch, 9),
                         jnp.int32)
    context = jnp.asarray([33, 7, 20], jnp.int32)
    query = jnp.asarray([cols, 1, cols], jnp.int32)
    q = jnp.asarray(rng.standard_normal((batch, cols, heads, 8)), jnp.float32)

    def attend(impl):
        fn = lambda q, pool: attention_xla.paged_attention(
            q, pool, 2, tables, context, query, scale=0.3, gather_impl=impl)
        return jax.jit(fn)

    native_text = attend("auto").lower(q, pool).as_text()
    assert native.KV_GATHER_TARGET in native_text  # the CPU program really uses it
    assert native.KV_GATHER_TARGET not in attend("xla").lower(q, pool).as_text()
    got, want = attend("auto")(q, pool), attend("xla")(q, pool)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_unknown_gather_impl_is_rejected():
    pool = _pool(np.random.default_rng(3))
    q = jnp.zeros((1, 1, 3, 8), jnp.float32)
    one = jnp.ones((1,), jnp.int32)
    with pytest.raises(ValueError, match="gather_impl"):
        attention_xla.paged_attention(q, pool, 0, jnp.zeros((1, 2), jnp.int32), one, one,
                                      scale=1.0, gather_impl="numpy")


def test_build_failure_names_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("SUPERINFER_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(native.NativeBuildError, match="false"):
        native.build()
    assert not list(tmp_path.glob("*.so"))


@pytest.mark.parametrize("value,want", [("0", False), ("off", False), ("1", True), ("", True)])
def test_switch_parses(monkeypatch, value, want):
    monkeypatch.setenv("SUPERINFER_NATIVE_OPS", value)
    assert native.enabled() is want
