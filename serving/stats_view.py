"""What the servers read from the engine's stats: a typed ``EngineStats``.

The serving loop hands the fronts a snapshot of ``LLMEngine.stats()`` (plus its own
``num_requests_total``); ``read`` turns it into an ``EngineStats`` (``superinfer_jax.stats``,
which knows exactly the keys the engine produces), and the gRPC stats and the metrics
read its fields. Before the engine exists (warm-up) the snapshot is empty: every count is 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from superinfer_jax.stats import EngineStats


def read(stats: Mapping[str, Any]) -> EngineStats:
    """The typed stats of a snapshot (an ``EngineStats`` already, or its flat dict)."""
    return EngineStats.from_dict(stats)


def numeric(stats: Mapping[str, Any]) -> dict[str, float]:
    """Every stat as the engine reported it (checked by ``read``), for clients that want
    them verbatim: none before the engine exists."""
    return {k: float(v) for k, v in read(stats).items()} if stats else {}
