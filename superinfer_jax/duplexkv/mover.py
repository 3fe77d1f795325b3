"""Jitted page gather and scatter on the device pool, and the copies to the host tier. A
batch is cut into power-of-two buckets that sum to it exactly (no padding page copies).

Copy modes (``default_copy_mode`` picks one per backend):
- ``device_put`` (GPU, TPU): gather into device staging pages, then batched async
  ``device_put`` to pinned_host and back: the copies run on the transfer streams, beside
  the step on the compute stream, which is what makes rotation overlap compute;
- ``fused`` (CPU, where both memory kinds are the same RAM): the programs read and write
  pinned_host pages directly, one copy per page each way instead of two (on one device
  by ``native.gather_pages`` / ``scatter_pages``; ``NATIVE_PAGE_COPIES`` turns them off);
- ``in_step`` (opt-in): inside the model step's program; the rest as in ``fused``.
Measurements: docs/results/duplexkv.md.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from superinfer_jax.config import COPY_MODES
from superinfer_jax.kv.layout import NULL_PAGE, PoolLayout
from superinfer_jax.ops import native

NATIVE_PAGE_COPIES = True  # fused mode's copies through page_copy.cc on CPU (off: XLA's)

MAX_BUCKET_PAGES = 64  # pages per staging batch: 128 MiB of Llama-3-8B pages
HOST_OPERAND_MODES = ("fused", "in_step")  # the separate programs read/write host pages


def default_copy_mode(platform: str | None = None) -> str:
    """``fused`` on CPU, else ``device_put``; ``in_step`` is opt-in."""
    return "fused" if (platform or jax.default_backend()) == "cpu" else "device_put"


def staging_buckets(max_pages: int) -> tuple[int, ...]:
    """Staging batch sizes: 1, 2, 4, 8, ... up to ``max_pages`` (included)."""
    out, b = [], 1
    while b < max_pages:
        out.append(b)
        b *= 2
    out.append(max_pages)
    return tuple(out)


def _gather(pool: jax.Array, ids: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(pool[ids[i]] for i in range(ids.shape[0]))


def _scatter(pool: jax.Array, ids: jax.Array, pages: tuple[jax.Array, ...]) -> jax.Array:
    # One in-place dynamic-update-slice per page: no [B, ...] staging copy is built.
    for i, page in enumerate(pages):
        pool = jax.lax.dynamic_update_index_in_dim(pool, page.astype(pool.dtype), ids[i], 0)
    return pool


def _gather_native(pool: jax.Array, ids: jax.Array) -> tuple[jax.Array, ...]:
    """``_gather`` by ``native.gather_pages`` on CPU; one device only (no sharding rule)."""
    return jax.lax.platform_dependent(pool, ids, cpu=native.gather_pages, default=_gather)


def _scatter_native(pool: jax.Array, ids: jax.Array,
                    pages: tuple[jax.Array, ...]) -> jax.Array:
    """``_scatter`` by ``native.scatter_pages`` on CPU, in place; one device only."""
    pages = tuple(p.astype(pool.dtype) for p in pages)
    return jax.lax.platform_dependent(
        pool, ids, *pages, cpu=lambda pool, ids, *pages: native.scatter_pages(pool, ids, pages),
        default=lambda pool, ids, *pages: _scatter(pool, ids, pages))


def _scatter_from_host(pool: jax.Array, ids: jax.Array, pages: tuple[jax.Array, ...],
                       scatter=_scatter) -> jax.Array:
    # moved to the device inside the program: XLA:CPU copies each once, into the pool
    return scatter(pool, ids, tuple(jax.device_put(p, jax.memory.Space.Device) for p in pages))


def land_in_step(pool: jax.Array, in_ids: jax.Array,
                 in_pages: tuple[jax.Array, ...]) -> jax.Array:
    """``in_step`` mode, first in the step: host pages ``in_pages`` into ``pool[in_ids]``."""
    return _scatter_from_host(pool, in_ids, in_pages) if in_pages else pool


def gather_in_step(pool: jax.Array, out_ids: jax.Array) -> tuple[jax.Array, ...]:
    """``in_step`` mode, last in the step (see ``rotation``): ``pool[out_ids]``."""
    return _gather(pool, out_ids)


class PageMover:
    """Batched whole-page gather/scatter, and copies between the pool and host pages."""

    def __init__(self, layout: PoolLayout, max_pages: int,
                 device_sharding: jax.sharding.Sharding,
                 host_sharding: jax.sharding.Sharding,
                 pool_sharding: jax.sharding.NamedSharding | None = None,
                 copy_mode: str | None = None):
        """``pool_sharding`` (tensor parallelism): pages are split as the pool is."""
        self.layout = layout
        device: Any = next(iter(device_sharding.device_set))  # jax.Device: no stubs
        self.copy_mode = copy_mode or default_copy_mode(device.platform)
        if self.copy_mode not in COPY_MODES:
            raise ValueError(f"copy_mode must be one of {COPY_MODES}, got {self.copy_mode!r}")
        self.device_sharding = device_sharding
        self.host_sharding = host_sharding
        self.buckets = staging_buckets(max(1, min(max_pages, MAX_BUCKET_PAGES)))
        fused = self.host_operands
        gather_out = host_sharding if fused else (device_sharding if pool_sharding else None)
        self.native_copies = (fused and pool_sharding is None and NATIVE_PAGE_COPIES
                              and native.available())
        gather = _gather_native if self.native_copies else _gather
        scatter = (functools.partial(_scatter_from_host, scatter=_scatter_native)
                   if self.native_copies else _scatter_from_host if fused else _scatter)
        self._gather = jax.jit(gather, out_shardings=gather_out)
        self._scatter = jax.jit(scatter, donate_argnums=(0,), out_shardings=pool_sharding or (
            device_sharding if fused else None))

    @property
    def host_operands(self) -> bool:
        """Whether the separate programs take and return host pages (fused, in_step)."""
        return self.copy_mode in HOST_OPERAND_MODES

    @property
    def max_pages(self) -> int:
        return self.buckets[-1]

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        """(start, bucket) pieces covering ``n`` pages exactly, largest bucket first."""
        out, start = [], 0
        while start < n:
            bucket = max(b for b in self.buckets if b <= n - start)
            out.append((start, bucket))
            start += bucket
        return out

    def gather(self, pool: jax.Array, page_ids: list[int]) -> list[jax.Array]:
        """One array per page id, dispatched: staging pages, or (fused) host pages."""
        out: list[jax.Array] = []
        for start, bucket in self._chunks(len(page_ids)):
            out.extend(self._gather(pool, np.asarray(page_ids[start:start + bucket], np.int32)))
        return out

    def to_host(self, pool: jax.Array, page_ids: list[int]) -> list[jax.Array]:
        pages = self.gather(pool, page_ids)
        if self.host_operands or not pages:
            return pages
        return list(jax.device_put(pages, self.host_sharding))

    def to_device(self, host_pages: list[jax.Array]) -> list[jax.Array]:
        """What ``scatter`` later lands: device copies issued now, or (fused) the pages."""
        if self.host_operands or not host_pages:
            return list(host_pages)
        return list(jax.device_put(host_pages, self.device_sharding))

    def scatter(self, pool: jax.Array, page_ids: list[int],
                pages: list[jax.Array]) -> jax.Array:
        """Write ``pages[i]`` to ``pool[page_ids[i]]`` (``pool`` donated)."""
        if len(page_ids) != len(pages):
            raise ValueError(f"{len(page_ids)} page ids for {len(pages)} pages")
        for start, bucket in self._chunks(len(page_ids)):
            pool = self._scatter(pool, np.asarray(page_ids[start:start + bucket], np.int32),
                                 tuple(pages[start:start + bucket]))
        return pool

    def compile_ahead(self, pool: jax.ShapeDtypeStruct, bucket: int) -> None:
        """Compile one bucket's gather and scatter from an abstract pool, on any thread."""
        ids = np.full(bucket, NULL_PAGE, np.int32)
        self._gather.lower(pool, ids).compile()
        sharding = self.host_sharding if self.host_operands else self.device_sharding
        page = jax.ShapeDtypeStruct(pool.shape[1:], pool.dtype, sharding=sharding)
        self._scatter.lower(pool, ids, (page,) * bucket).compile()

    def warmup(self, pool: jax.Array) -> jax.Array:
        """Compile every bucket and both copies now (reads and rewrites the null page)."""
        for bucket in self.buckets:
            ids = np.full(bucket, NULL_PAGE, np.int32)
            pool = self._scatter(pool, ids, self._gather(pool, ids))
        pages = self.to_device(self.to_host(pool, [NULL_PAGE]))
        pool = self.scatter(pool, [NULL_PAGE], pages)
        jax.block_until_ready(pool)
        return pool
