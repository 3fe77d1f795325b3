"""``ops.grouped_matmul``, the MoE layer's expert matmul: every CPU path (the native kernel
of ``ops/native/grouped_matmul.cc``, the XLA row tiles and gather, ``ragged_dot``) against
the plain ``jnp`` reference on ragged shapes (empty groups, rows past the groups, sizes that
are multiples of nothing), in bfloat16 and float32; a row's bits independent of the rows
beside it through the native kernel; the weights of groups without rows never read; the
native op only in the CPU program. ``make test`` runs this file once more with
``SUPERINFER_NATIVE_OPS=0``, where ``"auto"`` takes the XLA path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from superinfer_jax.ops import native
from superinfer_jax.ops.grouped_matmul import (
    GATHER_MAX_ROWS,
    grouped_matmul,
    grouped_matmul_reference,
)
from tests.numerics import BF16_EPS, assert_close, f32_tolerance

DTYPES = ("float32", "bfloat16")
HAVE_KERNEL = {d: native.grouped_matmul_available(d) for d in DTYPES}
# The paths on CPU: "auto" is "native" where the kernel runs and "xla" where it does not
# (SUPERINFER_NATIVE_OPS=0); both are also forced, and ragged_dot is the third opinion.
IMPLS = ("auto", "xla", "ragged_dot")

# (group sizes, m, k, n): empty first / middle / last groups, rows past sum(sizes), one
# row, rows in the gather range (<= GATHER_MAX_ROWS), groups larger than a row tile and
# than a kernel row block (8), odd k, n off every vector width (16, 32) and over a tile.
CASES = [
    ((0, 3, 0, 2, 1), 7, 33, 45),
    ((1,), 1, 64, 31),
    ((0, 2, 0), 3, 7, 16),
    ((5, 0, 17, 1, 0, 9), 37, 96, 130),
    ((2, 2, 2, 2), 9, 64, 200),
    ((0, 0, 40, 0), 40, 577, 33),
    ((3, 11, 0, 6, 1, 1, 0, 4), 29, 128, 288),
    ((0, 0, 0), 5, 16, 64),
]


def _operands(sizes: tuple[int, ...], m: int, k: int, n: int, dtype: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.standard_normal((m, k), np.float32), dtype)
    rhs = jnp.asarray(rng.standard_normal((len(sizes), k, n), np.float32) * 0.1, dtype)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32)


def _bound(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array) -> float:
    """Both sides sum k float32 products (exact for bfloat16 operands) in some order: twice
    float32's bound over the terms' magnitude, |lhs| times |its group's weight|."""
    terms = grouped_matmul_reference(jnp.abs(lhs.astype(jnp.float32)),
                                     jnp.abs(rhs.astype(jnp.float32)), sizes)
    return 2 * f32_tolerance(np.maximum(np.asarray(terms), 1e-30), lhs.shape[1])


def _call(impl: str, **kw):
    return jax.jit(lambda a, b, c: grouped_matmul(a, b, c, impl=impl, **kw))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"m{c[1]}k{c[2]}n{c[3]}g{len(c[0])}")
def test_matches_the_reference(case, impl: str, dtype: str) -> None:
    lhs, rhs, sizes = _operands(*case, dtype)
    got = _call(impl, preferred_element_type=jnp.float32)(lhs, rhs, sizes)
    want = grouped_matmul_reference(lhs, rhs, sizes)
    assert got.dtype == jnp.float32 and got.shape == want.shape
    assert_close(got, want, _bound(lhs, rhs, sizes), f"{impl} {dtype} {case}")
    past = int(np.sum(case[0]))
    assert not np.asarray(got[past:]).any(), "rows past sum(group_sizes) must be zeros"


@pytest.mark.parametrize("impl", ("auto", "xla"))
def test_result_dtype_follows_ragged_dot(impl: str) -> None:
    """No ``preferred_element_type``: the operands' dtype, as ragged_dot returns."""
    lhs, rhs, sizes = _operands((2, 0, 3), 6, 40, 24, "bfloat16")
    got = _call(impl)(lhs, rhs, sizes)
    assert got.dtype == jax.lax.ragged_dot(lhs, rhs, sizes).dtype == jnp.bfloat16
    want = grouped_matmul_reference(lhs, rhs, sizes)
    # One rounding to bfloat16 on top of the float32 sum.
    bound = _bound(lhs, rhs, sizes) + BF16_EPS / 2 * float(jnp.max(jnp.abs(want)))
    assert_close(got.astype(jnp.float32), want, bound, "bfloat16 out")


@pytest.mark.parametrize("impl", ("auto", "xla"))
@pytest.mark.parametrize("m", (2, 24))
def test_groups_without_rows_are_never_read(impl: str, m: int) -> None:
    """Experts no row is routed to hold NaN: a path that multiplied them (ragged_dot's
    dense lowering on CPU) would spread it; these read only the routed experts."""
    sizes = (0, m // 2, 0, m - m // 2, 0) if m > GATHER_MAX_ROWS else (0, 1, 0, 1, 0)
    lhs, rhs, group_sizes = _operands(sizes, m, 48, 40, "float32")
    poisoned = rhs.at[jnp.asarray([0, 2, 4])].set(jnp.nan)
    got = _call(impl, preferred_element_type=jnp.float32)(lhs, poisoned, group_sizes)
    assert np.isfinite(np.asarray(got)).all()
    assert_close(got, grouped_matmul_reference(lhs, rhs, group_sizes),
                 _bound(lhs, rhs, group_sizes), f"{impl} with NaN in unrouted experts")


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_bits_do_not_depend_on_the_other_rows(dtype: str) -> None:
    """Through the native kernel a row's result is one float32 sum in a fixed order, so
    its bits stay whatever the other rows are, how many there are and how they are
    grouped: every subset of the rows (other groups emptied or shrunk, the rows beside it
    replaced by new values) gives the same bits for the rows it keeps."""
    if not HAVE_KERNEL[dtype]:
        pytest.skip(f"no native grouped matmul for {dtype} here (SUPERINFER_NATIVE_OPS=0, no "
                    "compiler or no AVX-512): the XLA path makes no such promise")
    sizes = (9, 0, 3, 17, 1, 12)
    lhs, rhs, group_sizes = _operands(sizes, 42, 200, 100, dtype, seed=1)
    call = _call("native", preferred_element_type=jnp.float32)
    full = np.asarray(call(lhs, rhs, group_sizes))
    group = np.repeat(np.arange(len(sizes)), sizes)
    rng = np.random.default_rng(2)
    for trial in range(6):
        keep = np.sort(rng.choice(42, size=int(rng.integers(1, 42)), replace=False))
        sub_sizes = jnp.asarray(np.bincount(group[keep], minlength=len(sizes)), jnp.int32)
        extra = int(rng.integers(0, 4))  # rows past the groups: ignored, zeros
        noise = jnp.asarray(rng.standard_normal((extra, 200), np.float32), dtype)
        got = np.asarray(call(jnp.concatenate([lhs[keep], noise]), rhs, sub_sizes))
        np.testing.assert_array_equal(got[:keep.size], full[keep], err_msg=f"trial {trial}")
        assert not got[keep.size:].any()
    # Rows 10-19 (of groups 2 and 3) replaced: the rows after them, group 3's among them,
    # keep their bits.
    changed = lhs.at[10:20].set(-lhs[10:20])
    np.testing.assert_array_equal(np.asarray(call(changed, rhs, group_sizes))[20:], full[20:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_op_only_in_the_cpu_program(dtype: str) -> None:
    lhs, rhs, sizes = _operands((1, 2), 3, 16, 32, dtype)
    step = jax.jit(lambda a, b, c: grouped_matmul(a, b, c))
    cpu = step.lower(lhs, rhs, sizes).as_text()
    assert (native.GROUPED_MATMUL_TARGET in cpu) == HAVE_KERNEL[dtype]
    cuda = step.trace(lhs, rhs, sizes).lower(lowering_platforms=("cuda",)).as_text()
    assert native.GROUPED_MATMUL_TARGET not in cuda and "ragged_dot" in cuda
    if not native.enabled():
        assert not HAVE_KERNEL[dtype]


def test_bad_operands_name_the_problem() -> None:
    lhs, rhs, sizes = _operands((1, 2), 3, 16, 32, "float32")
    with pytest.raises(ValueError, match="do not chain"):
        grouped_matmul(lhs[:, :8], rhs, sizes)
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_matmul(lhs, rhs, sizes[:1])
    with pytest.raises(ValueError, match="impl must be one of"):
        grouped_matmul(lhs, rhs, sizes, impl="dense")
    with pytest.raises(ValueError, match="no native kernel"):  # mixed dtypes: never native
        grouped_matmul(lhs, rhs.astype(jnp.bfloat16), sizes, impl="native")
    with pytest.raises(ValueError, match="both be bfloat16 or both float32"):
        native.grouped_matmul(lhs, rhs.astype(jnp.bfloat16), sizes)
