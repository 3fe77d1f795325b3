"""Page-table arithmetic shared by the XLA reference and the Pallas kernel: both pad a
row's table to whole tiles with the null page, so both read the same pages."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from superinfer_jax.kv.layout import NULL_PAGE


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for static sizes, in integers (no float rounding on large counts)."""
    return -(-a // b)


def pad_page_table(page_tables: jax.Array, num_pages: int) -> jax.Array:
    """[B, P] -> [B, num_pages] (``num_pages >= P``), the new slots pointing at the null page."""
    return jnp.pad(page_tables, ((0, 0), (0, num_pages - page_tables.shape[1])),
                   constant_values=NULL_PAGE)
