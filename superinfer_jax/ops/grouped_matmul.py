"""Grouped matmul for mixture-of-experts layers: rows sorted by expert, one weight per group.

``grouped_matmul(lhs, rhs, group_sizes)`` multiplies row block ``g`` of ``lhs`` (the
``group_sizes[g]`` rows after those of groups ``< g``) by ``rhs[g]``, the contract of
``jax.lax.ragged_dot``. Rows past ``sum(group_sizes)`` come back as zeros. A MoE layer
sorts its (token, chosen expert) pairs by expert, calls this once per projection and
unsorts: dropless routing without a loop over the experts.

How it computes, per platform (``impl``):

- GPU and every other non-CPU platform: ``jax.lax.ragged_dot``.
- CPU, ``"native"``: the C++ kernel of ``superinfer_jax.ops.native`` (``grouped_matmul.cc``),
  which reads only the weights of groups that have rows, once each; float32 accumulation,
  and a row's bits depend on its own values and its group's weight alone (batch-invariant).
  For bfloat16 or float32 operands of one dtype, on CPUs with AVX-512F (AVX512-BF16 for
  bfloat16).
- CPU, ``"xla"``: a loop over row tiles of the groups that have rows, one dot with that
  group's weight each (up to ``GATHER_MAX_ROWS`` rows: each row's weight gathered); for
  ``SUPERINFER_NATIVE_OPS=0``, CPUs without the kernel and mixed dtypes. On XLA:CPU
  ``ragged_dot`` masks the rows into a dense ``[groups, m, k]`` operand and multiplies
  every group's weight, so its cost grows with the number of experts, this loop's with
  the number of groups the rows are routed to.
- ``"auto"`` (the default): ``"native"`` where it runs, else ``"xla"``.
- ``"ragged_dot"``: ``jax.lax.ragged_dot`` on every platform (a reference, and what a
  sharded caller outside ``shard_map`` wants: a custom call has no sharding rule).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from superinfer_jax.ops import native

IMPLS = ("auto", "native", "xla", "ragged_dot")


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                   preferred_element_type=None, impl: str = "auto") -> jax.Array:
    """``[m, k] x [g, k, n]`` with ``group_sizes: [g]`` int32 -> ``[m, n]``, in
    ``preferred_element_type`` (default: the operands' promoted dtype), as ragged_dot."""
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"grouped_matmul: lhs {lhs.shape} and rhs {rhs.shape} do not chain")
    if group_sizes.shape != (rhs.shape[0],):
        raise ValueError(f"grouped_matmul: group_sizes {group_sizes.shape} for "
                         f"{rhs.shape[0]} groups")
    if impl not in IMPLS:
        raise ValueError(f"grouped_matmul: impl must be one of {IMPLS}, got {impl!r}")
    out_dtype = jnp.dtype(preferred_element_type if preferred_element_type is not None
                          else jnp.result_type(lhs.dtype, rhs.dtype))
    sizes = group_sizes.astype(jnp.int32)

    def ragged(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array) -> jax.Array:
        return jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=out_dtype)

    if impl == "ragged_dot":
        return ragged(lhs, rhs, sizes)
    runs_native = lhs.dtype == rhs.dtype and native.grouped_matmul_available(lhs.dtype)
    if impl == "native" and not runs_native:
        raise ValueError(f"grouped_matmul: no native kernel here for {lhs.dtype} x "
                         f"{rhs.dtype} (see superinfer_jax.ops.native)")
    if impl == "auto":
        impl = "native" if runs_native else "xla"

    def on_cpu(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array) -> jax.Array:
        if impl == "native":
            return native.grouped_matmul(lhs, rhs, sizes).astype(out_dtype)
        return grouped_matmul_xla(lhs, rhs, sizes).astype(out_dtype)

    return jax.lax.platform_dependent(lhs, rhs, sizes, cpu=on_cpu, default=ragged)


GATHER_MAX_ROWS = 4


def grouped_matmul_xla(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """The CPU path without the native kernel -> float32 ``[m, n]``: up to
    ``GATHER_MAX_ROWS`` rows (a decode step of one or two tokens) gather each row's weight
    and multiply row by row; more loop over row tiles (``grouped_matmul_tiles``)."""
    if lhs.shape[0] <= GATHER_MAX_ROWS:
        return grouped_matmul_gather(lhs, rhs, group_sizes)
    return grouped_matmul_tiles(lhs, rhs, group_sizes)


def _group_of_row(group_sizes: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """Each row's group (clamped to the last) and whether the row is in any group."""
    ends = jnp.cumsum(jnp.maximum(group_sizes, 0))
    rows = jnp.arange(m)
    group = jnp.sum(ends[None, :] <= rows[:, None], axis=1)
    return jnp.minimum(group, group_sizes.shape[0] - 1), rows < ends[-1]


def grouped_matmul_gather(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Each row times its own group's weight, gathered ``[m, k, n]``: reads one weight per
    row, so for few rows -> float32 ``[m, n]``."""
    m = lhs.shape[0]
    if not m or not rhs.shape[0]:
        return jnp.zeros((m, rhs.shape[2]), jnp.float32)
    group, inside = _group_of_row(group_sizes, m)
    bits = rhs.dtype == jnp.bfloat16  # gathered as bits: see _to_float32
    weights = jnp.take(jax.lax.bitcast_convert_type(rhs, jnp.uint16) if bits else rhs, group,
                       axis=0)
    out = jnp.einsum("mk,mkn->mn", lhs.astype(jnp.float32), _to_float32(weights))
    return jnp.where(inside[:, None], out, 0.0)


def row_tile(m: int, groups: int) -> int:
    """Rows per dot of ``grouped_matmul_tiles``: about twice a group's share of the rows
    (most groups then take one tile, one read of their weight), a power of two in
    [2, 256] (two or more: XLA:CPU runs a one-row bfloat16 dot as a matrix-vector product
    that converts the whole weight to float32 first)."""
    share = -(-2 * m // max(groups, 1))
    return min(256, max(2, 1 << max(share - 1, 0).bit_length()))


def grouped_matmul_tiles(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                         tile: int | None = None) -> jax.Array:
    """The XLA path: a loop over tiles of ``tile`` rows of each group with rows, each one
    dot ``[tile, k] x [k, n]`` with the group's weight (float32 accumulation), its rows
    past the group's end masked out. Reads the weights of the groups with rows only, each
    once per tile of its rows -> float32 ``[m, n]`` (bfloat16 weights: XLA:CPU, which has
    no bfloat16 arithmetic, first converts all of them to float32 once per call)."""
    m, k = lhs.shape
    n = rhs.shape[2]
    tile = tile or row_tile(m, rhs.shape[0])
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes, 0)), m)
    starts = jnp.concatenate([jnp.zeros((1,), ends.dtype), ends[:-1]])
    tiles = (ends - starts + tile - 1) // tile  # per group; 0 for empty groups
    tile_ends = jnp.cumsum(tiles)
    padded = jnp.pad(lhs, ((0, tile), (0, 0)))  # a tile may start up to m - 1

    def body(t: jax.Array, out: jax.Array) -> jax.Array:
        group = jnp.sum(tile_ends <= t)  # the group tile t is in
        row0 = starts[group] + (t - tile_ends[group] + tiles[group]) * tile
        x = jax.lax.dynamic_slice_in_dim(padded, row0, tile)
        y = jnp.dot(x.astype(jnp.float32), rhs[group].astype(jnp.float32))
        inside = (row0 + jnp.arange(tile) < ends[group])[:, None]
        kept = jax.lax.dynamic_slice_in_dim(out, row0, tile)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(inside, y, kept), row0, 0)

    out = jnp.zeros((m + tile, n), jnp.float32)
    if m and k and rhs.shape[0]:
        out = jax.lax.fori_loop(0, tile_ends[-1], body, out)
    return out[:m]


def _to_float32(w: jax.Array) -> jax.Array:
    """float32 values of ``w``; uint16 ``w`` holds bfloat16 bits (a float32's top half), so
    that XLA:CPU converts only the gathered weights, not every expert before the gather."""
    if w.dtype != jnp.uint16:
        return w.astype(jnp.float32)
    return jax.lax.bitcast_convert_type(w.astype(jnp.uint32) << 16, jnp.float32)


def grouped_matmul_reference(lhs: jax.Array, rhs: jax.Array,
                             group_sizes: jax.Array) -> jax.Array:
    """Plain ``jnp`` reference: each row times its own group's weight, float32."""
    ends = jnp.cumsum(group_sizes)
    rows = jnp.arange(lhs.shape[0])
    group_of_row = jnp.searchsorted(ends, rows, side="right")
    in_some_group = rows < ends[-1]
    weights = rhs[jnp.minimum(group_of_row, rhs.shape[0] - 1)].astype(jnp.float32)
    out = jnp.einsum("mk,mkn->mn", lhs.astype(jnp.float32), weights)
    return jnp.where(in_some_group[:, None], out, 0.0)
