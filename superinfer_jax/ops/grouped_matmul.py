"""Grouped matmul for mixture-of-experts layers: rows sorted by expert, one weight per group.

``grouped_matmul(lhs, rhs, group_sizes)`` multiplies row block ``g`` of ``lhs`` (the
``group_sizes[g]`` rows after those of groups ``< g``) by ``rhs[g]``, the contract of
``jax.lax.ragged_dot``. Rows past ``sum(group_sizes)`` come back as zeros. A MoE layer
sorts its (token, chosen expert) pairs by expert, calls this once per projection and
unsorts: dropless routing without a loop over the experts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                   preferred_element_type=None) -> jax.Array:
    """``[m, k] x [g, k, n]`` with ``group_sizes: [g]`` int32 -> ``[m, n]``."""
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"grouped_matmul: lhs {lhs.shape} and rhs {rhs.shape} do not chain")
    if group_sizes.shape != (rhs.shape[0],):
        raise ValueError(f"grouped_matmul: group_sizes {group_sizes.shape} for "
                         f"{rhs.shape[0]} groups")
    return jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32),
                              preferred_element_type=preferred_element_type)


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
