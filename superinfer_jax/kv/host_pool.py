"""The host tier's storage: one pinned-host array ``[num_layers, 2, page_size, kv_heads,
head_dim]`` per host page id; the ids' bookkeeping lives in ``two_tier``.

One array per page, not one preallocated host array: writing a page into such an array
is a dynamic-update-slice of a host operand, which XLA:CPU upcasts over the whole array
for bf16 and which on GPU needs the host-offload pass. A page array is written once, by
the copy that creates it, and only read after, so freeing a page drops a reference (a
copy in flight holds its own) and reusing one never races with a transfer.
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
    """Arrays of the host tier, by host page id. ``page_sharding`` (tensor parallelism):
    host pages are split as device pages are, so each device copies its own slice;
    without it, pages live on ``device`` (default: the first device)."""

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
