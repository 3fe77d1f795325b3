"""KV page layout: block-first, so one page of one request is one contiguous copy.

    pool[num_pages, num_layers, 2 (K, V), page_size, num_kv_heads, head_dim]
          |          '--------- one page: contiguous bytes, all layers, K and V ---------'
          '- page id (page 0 is the null page: padding writes land there, nobody reads it)

Rotation (DuplexKV) moves whole pages, so a page being one contiguous run of bytes makes
it one copy instead of ``2 * num_layers`` copies. Attention reads ``pool[page_ids, layer]``,
a gather whose slice is one (layer, K|V) plane of a page; the pool itself is never copied.

Measured against one pool per layer (``python -m benchmarks.duplex --layouts``, 2-core
CPU, Llama-3-8B pages of 2 MiB): rotating 64 pages out takes 13 ms block-first (64 copies,
10.4 GB/s) against 51 ms per layer (2048 copies of 64 KiB, 2.7 GB/s); the part of a step
the layout touches (KV write + paged attention, 30 layers, decode batch 8, context 512)
takes 20.1 ms against 18.7 ms, with no pool copy in either compiled step (the SmolLM2
step takes the same 30 ms with a 54 MB or a 431 MB pool). Block-first costs the step
about 7% on CPU and makes rotation 4x cheaper, so it stays. One caveat it carries: a
layer's KV write must depend on the previous layer's output (true in any model), or XLA
copies the whole pool to order the write after the previous layer's reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from superinfer_jax.model_api import KVSpec

NULL_PAGE = 0


@dataclass(frozen=True)
class PoolLayout:
    """Shape arithmetic of a pool for one model, page size and dtype."""

    kv_spec: KVSpec
    page_size: int
    dtype: str

    def page_shape(self) -> tuple[int, ...]:
        s = self.kv_spec
        return (s.num_layers, 2, self.page_size, s.num_kv_heads, s.head_dim)

    def pool_shape(self, num_pages: int) -> tuple[int, ...]:
        return (num_pages, *self.page_shape())

    @property
    def page_bytes(self) -> int:
        return int(np.prod(self.page_shape())) * jnp.dtype(self.dtype).itemsize

    def pages_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def zeros(self, num_pages: int) -> jnp.ndarray:
        return jnp.zeros(self.pool_shape(num_pages), dtype=self.dtype)
