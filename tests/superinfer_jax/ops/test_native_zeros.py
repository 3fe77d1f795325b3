"""The native lazy zeros (a C++ XLA FFI custom call that releases memory to the kernel
instead of writing it): every byte zero, on fresh memory and on dirty memory it reuses,
and the engine's KV pool built with it is the pool XLA's fill builds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.servable import random_servable
from superinfer_jax import LLMEngine
from superinfer_jax.ops import native
from superinfer_jax.runner import device_pool
from tests.superinfer_jax.engine_testlib import SMALL, TINY

pytestmark = pytest.mark.skipif(
    not native.available(),
    reason="no C++ compiler here: the native ops are optional, XLA's fill is used",
)

# Sizes around the cases the call distinguishes: below its 16-page cut (a plain memset),
# just above it, and a few MiB whose start and end fall inside pages (edges memset,
# middle released).
_SHAPES = [(3,), (16 * 1024 + 5,), (5, 1000, 211)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8])
@pytest.mark.parametrize("shape", _SHAPES)
def test_fresh_buffer_is_all_zero(shape, dtype):
    got = jax.jit(lambda: native.lazy_zeros(shape, dtype))()
    assert got.shape == shape and got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), 0)


@pytest.mark.parametrize("shape", _SHAPES)
def test_dirty_buffer_it_reuses_reads_as_zero(shape):
    """The output aliases a donated buffer of -1.5s, so the call must zero memory that
    really held data (fresh allocations are usually zero already)."""
    spec = jax.ShapeDtypeStruct(shape, jnp.float32)
    zero_in_place = jax.jit(
        lambda dirty: jax.ffi.ffi_call(native.LAZY_ZEROS_TARGET, spec,
                                       input_output_aliases={0: 0})(dirty),
        donate_argnums=0)
    dirty = jnp.full(shape, -1.5, jnp.float32)
    address = dirty.unsafe_buffer_pointer()
    got = zero_in_place(dirty)
    assert got.unsafe_buffer_pointer() == address  # the same memory, reused
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), 0)
    # and it is ordinary memory afterwards: written, it keeps what was written
    written = jax.jit(lambda a: a.at[-1].set(2.0), donate_argnums=0)(got)
    assert float(written[-1].ravel()[0]) == 2.0
    assert float(jnp.abs(written[:-1]).sum()) == 0.0


def test_engine_pool_is_zero_and_built_by_the_call(monkeypatch):
    """The engine's pool on one CPU device comes from the lazy call, and is all zero."""
    calls = []
    lazy_zeros = native.lazy_zeros

    def counted(shape, dtype):
        calls.append(shape)
        return lazy_zeros(shape, dtype)

    monkeypatch.setattr(device_pool.native, "lazy_zeros", counted)
    engine = LLMEngine(random_servable(TINY), SMALL.replace(num_host_pages=8))
    runner = engine.runner
    pool = runner.kv_pool
    assert calls == [runner.layout.pool_shape(runner.num_device_pages)]
    assert pool.shape == calls[0]
    assert pool.sharding == runner.pool.spec.sharding
    np.testing.assert_array_equal(np.asarray(pool).view(np.uint8), 0)
