"""Per-expert token counts of a mixture-of-experts model, accumulated on the host.

The forward hands each step's counts ([routed layers, experts], valid tokens only) to
``ExpertCounts.add`` through ``jax.debug.callback``; the server exports them
(``serving.metrics``) summed over groups of consecutive routed layers, so a Prometheus
series count stays ``groups x experts`` however deep the model is, and load imbalance
(an expert far above ``tokens * top_k / experts``) shows per group.
"""

from __future__ import annotations

import threading

import numpy as np

MAX_LAYER_GROUPS = 4


class ExpertCounts:
    """Cumulative tokens routed to each expert of each routed layer."""

    def __init__(self, layers: tuple[int, ...], num_experts: int):
        self.layers = layers
        self.num_experts = num_experts
        self._counts = np.zeros((len(layers), num_experts), np.int64)
        self._lock = threading.Lock()

    def add(self, counts) -> None:
        """One step's counts, [len(layers), num_experts] (the debug callback)."""
        with self._lock:
            self._counts += np.asarray(counts, np.int64)

    def snapshot(self) -> np.ndarray:
        with self._lock:
            return self._counts.copy()

    def by_group(self, max_groups: int = MAX_LAYER_GROUPS) -> dict[str, np.ndarray]:
        """{"first-last" layer label: counts summed over those layers [num_experts]}, at
        most ``max_groups`` groups of consecutive routed layers, as even as they split."""
        counts = self.snapshot()
        out = {}
        for part in np.array_split(np.arange(len(self.layers)), min(max_groups,
                                                                    len(self.layers))):
            label = f"{self.layers[part[0]]}-{self.layers[part[-1]]}"
            out[label] = counts[part].sum(axis=0)
        return out
