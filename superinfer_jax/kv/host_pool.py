"""The host tier's storage: pinned-host page arrays, keyed by host page id.

    host page id (1..num_host_pages) -> jax.Array [num_layers, 2, page_size, kv_heads,
                                                   head_dim] in memory kind pinned_host

The ids (which page is free, who owns it) are bookkeeping and live in ``two_tier``; this
module only holds the arrays and knows the memory kinds.

Why one array per page, not one preallocated ``[num_host_pages, ...]`` pinned_host array:
writing a page into such an array is a jitted dynamic-update-slice of a host-memory
operand. On CPU that runs in place for 2-byte integer pages (0.1 ms per 2 MiB page,
``python -m benchmarks.duplex --layouts``), but XLA:CPU upcasts a bfloat16 update over
the whole array, and on GPU it relies on XLA's host-offload pass turning the update into
a DMA, which cannot be exercised without one. A page array needs nothing but the copy
that creates it (a ``device_put``, or on CPU the gather that writes it straight into
host memory: ``duplexkv.mover``'s fused mode), the same on every backend: it is written
once, by that copy, and only read afterwards, so a freed page is a dropped reference (an
in-flight copy holds its own) and reusing a host page can never race with a transfer.
Capacity is enforced by the host free list (``num_host_pages``); memory is taken as
pages are used.
"""

from __future__ import annotations

from typing import Any

import jax

HOST_MEMORY_KINDS = ("pinned_host", "unpinned_host")


def host_memory_kind(device: jax.Device) -> str:
    """The host memory kind this device can copy to: pinned where the backend has it."""
    kinds = {m.kind for m in device.addressable_memories()}
    for kind in HOST_MEMORY_KINDS:
        if kind in kinds:
            return kind
    raise RuntimeError(f"device {device} exposes no host memory kind (has {sorted(kinds)})")


def num_host_pages_for(host_memory_gb: float, num_host_pages: int | None,
                       page_bytes: int) -> int:
    """Host tier capacity in pages: ``num_host_pages`` if set, else ``host_memory_gb``."""
    if num_host_pages is not None:
        return num_host_pages
    return int(host_memory_gb * (1 << 30)) // page_bytes


class HostPool:
    """Arrays of the host tier. Holds references only; ids are owned by the KV manager.

    ``page_sharding`` (tensor parallelism): where a device page lives, e.g. split over KV
    heads on a mesh. Host pages then use the same sharding in host memory, so each
    device's slice of a page is copied to and from its own host's memory, never between
    devices. Without it, pages live on ``device`` (default: the first device).
    """

    def __init__(self, num_pages: int, device: jax.Device | None = None,
                 page_sharding: jax.sharding.Sharding | None = None):
        self.num_pages = num_pages
        if page_sharding is None:
            self.device = device or jax.devices()[0]
            page_sharding = jax.sharding.SingleDeviceSharding(self.device)
        else:  # memory kinds are asked of a device this process drives
            devices: list[Any] = list(page_sharding.device_set)  # jax.Device: no stubs
            mine = [d for d in devices if d.process_index == jax.process_index()]
            self.device = min(mine, key=lambda d: d.id)
        self.memory_kind = host_memory_kind(self.device)
        self.host_sharding = page_sharding.with_memory_kind(self.memory_kind)
        self.device_sharding = page_sharding.with_memory_kind("device")
        self._pages: dict[int, jax.Array] = {}  # host page id -> [L, 2, S, K, D]

    def put(self, host_pages: list[int], arrays: list[jax.Array]) -> None:
        for h, a in zip(host_pages, arrays, strict=True):
            if not 1 <= h <= self.num_pages:
                raise ValueError(f"host page {h} is outside [1, {self.num_pages}]")
            self._pages[h] = a

    def get(self, host_pages: list[int]) -> list[jax.Array]:
        return [self._pages[h] for h in host_pages]

    def holds(self, host_page: int, array: jax.Array) -> bool:
        """Whether ``host_page`` still stores exactly ``array`` (it may have been reused)."""
        return self._pages.get(host_page) is array

    def drop(self, host_pages: list[int]) -> None:
        for h in host_pages:
            self._pages.pop(h, None)

    @property
    def num_stored(self) -> int:
        return len(self._pages)

    def stored_pages(self) -> set[int]:
        return set(self._pages)
