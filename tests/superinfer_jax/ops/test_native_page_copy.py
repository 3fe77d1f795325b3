"""DuplexKV's fused-mode page copies through the native custom calls (``page_copy.cc``):
byte for byte what XLA's slices and in-place updates give, ids clamped, a repeated id's
later page winning, the pool updated in place."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from superinfer_jax.ops import native

pytestmark = pytest.mark.skipif(
    not native.available(), reason="no C++ compiler here: XLA's page copies are used")


def _pool(rng, dtype, num_pages=9, shape=(3, 2, 4, 2, 8)):
    return jnp.asarray(rng.standard_normal((num_pages, *shape)), jnp.float32).astype(dtype)


def _bytes(x) -> np.ndarray:
    return np.asarray(x).view(np.uint8)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("ids", [[3], [0, 8, 2, 2, 5], list(range(9)), [-7, 40]])
def test_gather_is_byte_exact(dtype, ids) -> None:
    pool = _pool(np.random.default_rng(len(ids)), dtype)
    got = jax.jit(native.gather_pages)(pool, jnp.asarray(ids, jnp.int32))
    assert len(got) == len(ids)
    for g, i in zip(got, ids, strict=True):
        assert g.shape == pool.shape[1:] and g.dtype == pool.dtype
        np.testing.assert_array_equal(_bytes(g), _bytes(pool[min(max(i, 0), 8)]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_scatter_is_byte_exact_in_place_and_later_pages_win(dtype) -> None:
    rng = np.random.default_rng(3)
    pool = _pool(rng, dtype)
    pages = [_pool(rng, dtype, num_pages=1)[0] for _ in range(5)]
    ids = [4, 1, 4, 99, 0]  # 4 twice (the third page wins), 99 clamped to 8
    want = np.asarray(pool).copy()
    for i, page in zip(ids, pages, strict=True):
        want[min(i, 8)] = np.asarray(page)
    scatter = jax.jit(native.scatter_pages, donate_argnums=0)
    before = pool.unsafe_buffer_pointer()
    got = scatter(pool, jnp.asarray(ids, jnp.int32), pages)
    assert got.unsafe_buffer_pointer() == before  # the donated pool, written in place
    np.testing.assert_array_equal(_bytes(got), want.view(np.uint8))


@pytest.mark.parametrize("shape", [(3, 2, 4, 2, 8), (5, 3)])  # 1.5 KiB, and 60 bytes
def test_scatter_of_distinct_pages_on_all_threads(shape) -> None:
    """Distinct ids take the threaded path (few pages are split into pieces); a 60-byte
    page takes the unaligned head and tail copies."""
    rng = np.random.default_rng(6)
    pool = _pool(rng, jnp.float32, shape=shape)
    pages = [_pool(rng, jnp.float32, num_pages=1, shape=shape)[0] for _ in range(3)]
    ids = [7, 2, 5]
    want = np.asarray(pool).copy()
    for i, page in zip(ids, pages, strict=True):
        want[i] = np.asarray(page)
    got = jax.jit(native.scatter_pages, donate_argnums=0)(pool, jnp.asarray(ids, jnp.int32),
                                                          pages)
    np.testing.assert_array_equal(_bytes(got), want.view(np.uint8))
    back = jax.jit(native.gather_pages)(got, jnp.asarray(ids, jnp.int32))
    for b, page in zip(back, pages, strict=True):
        np.testing.assert_array_equal(_bytes(b), _bytes(page))


def test_bad_operands_name_the_problem() -> None:
    pool = _pool(np.random.default_rng(4), jnp.float32)
    with pytest.raises(ValueError, match="ids for 1 pages"):
        native.scatter_pages(pool, jnp.asarray([1, 2], jnp.int32), [pool[0]])
    with pytest.raises(ValueError, match="is not a page of"):
        native.scatter_pages(pool, jnp.asarray([1], jnp.int32), [pool[0, :2]])
