"""The engine's ``stats()`` dict, read tolerantly into the fields servers report.

The engine's stats grow as tiers land (host pages, rotations, bytes moved), and their
exact key names belong to the engine. Servers read them here, through a few accepted
spellings, and report 0 for what this engine build does not track, so the API and the
metrics stay the same whichever engine they front.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_NAMES: dict[str, tuple[str, ...]] = {
    "num_running": ("num_running",),
    "num_waiting": ("num_waiting",),
    "num_rotary": ("num_rotary", "num_rotary_requests", "num_swapped"),
    "device_pages_total": ("device_pages_total", "num_device_pages"),
    "device_pages_free": ("device_pages_free", "num_free_device_pages"),
    "host_pages_total": ("host_pages_total", "num_host_pages"),
    "host_pages_free": ("host_pages_free", "num_free_host_pages"),
    "bytes_to_host": ("transfer_bytes_out", "kv_bytes_to_host", "bytes_to_host"),
    "bytes_to_device": ("transfer_bytes_in", "kv_bytes_to_device", "bytes_to_device"),
    "num_requests_total": ("num_requests_total",),
}


def _lookup(stats: dict[str, Any], names: tuple[str, ...]) -> int:
    for name in names:
        value = stats.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return int(value)
    return 0


@dataclass(frozen=True)
class StatsView:
    num_running: int = 0
    num_waiting: int = 0
    num_rotary: int = 0
    device_pages_total: int = 0
    device_pages_free: int = 0
    host_pages_total: int = 0
    host_pages_free: int = 0
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    num_requests_total: int = 0

    @classmethod
    def of(cls, stats: dict[str, Any]) -> StatsView:
        return cls(**{field: _lookup(stats, names) for field, names in _NAMES.items()})

    @staticmethod
    def numeric(stats: dict[str, Any]) -> dict[str, float]:
        """Every numeric entry, for clients that want what the engine reports verbatim."""
        return {k: float(v) for k, v in stats.items()
                if isinstance(v, int | float) and not isinstance(v, bool)}

    def usage(self, tier: str) -> float:
        """Fraction of the tier's pages in use (0 when the tier does not exist)."""
        total, free = ((self.device_pages_total, self.device_pages_free) if tier == "device"
                       else (self.host_pages_total, self.host_pages_free))
        return 0.0 if total <= 0 else (total - free) / total
