"""KV page layout: block-first, so one page of one request is one contiguous copy.

    pool[num_pages, num_layers, 2 (K, V), page_size, num_kv_heads, head_dim]

Page 0 is the null page: padding writes land there, nobody reads it. Rotation moves whole
pages, so a contiguous page is one copy instead of ``2 * num_layers``; attention gathers
``pool[page_ids, layer]`` and never copies the pool. A layer's KV write must depend on
the previous layer's output (true in any model), or XLA copies the pool to order it.
Measurements: docs/results/duplexkv.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from superinfer_jax.kv import quant
from superinfer_jax.model_api import KVSpec

NULL_PAGE = 0


@dataclass(frozen=True)
class PoolLayout:
    """Shape arithmetic of a pool for one model, page size and KV dtype (``dtype``: a
    ``kv.quant.KV_DTYPES`` name; ``storage`` is the pool's element type)."""

    kv_spec: KVSpec
    page_size: int
    dtype: str

    @property
    def storage(self) -> jnp.dtype:
        return quant.storage_dtype(self.dtype)

    @property
    def scaled(self) -> bool:
        """Whether the pages need the engine's per-layer, per-head scales."""
        return self.dtype in quant.SCALED

    @property
    def scale_bytes(self) -> int:
        """Bytes of the scale array, once per engine (0 for an unscaled dtype)."""
        return quant.scale_bytes(self.dtype, self.kv_spec.num_layers,
                                 self.kv_spec.num_kv_heads)

    def scale_shape(self) -> tuple[int, int, int]:
        return (self.kv_spec.num_layers, 2, self.kv_spec.num_kv_heads)

    def page_shape(self) -> tuple[int, ...]:
        s = self.kv_spec
        return (s.num_layers, 2, self.page_size, s.num_kv_heads, s.head_dim)

    def pool_shape(self, num_pages: int) -> tuple[int, ...]:
        return (num_pages, *self.page_shape())

    @property
    def page_bytes(self) -> int:
        return int(np.prod(self.page_shape())) * self.storage.itemsize

    def pages_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def zeros(self, num_pages: int) -> jnp.ndarray:
        return jnp.zeros(self.pool_shape(num_pages), dtype=self.storage)
