"""Latency model: what a prefill chunk, a decode step and a page transfer cost here.

Profiled once per model and machine (at warm-up, or from a saved JSON profile), fitted
with non-negative coefficients so that more work is never predicted faster:

    prefill_s(tokens, context)       = p0 + p1 * tokens + p2 * tokens * context
    decode_s(batch, total_context)   = d0 + d1 * batch + d2 * total_context
    transfer_s(num_bytes)            = t0 + num_bytes / bandwidth
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict, dataclass, field

import numpy as np


def fit_nonnegative(features: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0 (active-set: drop negative ones and refit)."""
    x = np.asarray(features, np.float64)
    y = np.asarray(targets, np.float64)
    if x.ndim != 2 or len(x) != len(y) or len(y) == 0:
        raise ValueError("features must be [N, K] and targets [N] with N > 0")
    active = np.ones(x.shape[1], bool)
    coef = np.zeros(x.shape[1])
    while active.any():
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            return coef
        idx = np.flatnonzero(active)
        active[idx[np.argmin(sol)]] = False
    return coef


@dataclass
class LatencyModel:
    """Fitted coefficients (seconds) plus where they were measured."""

    prefill: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    decode: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    transfer: list[float] = field(default_factory=lambda: [0.0, 0.0])  # [t0, s/byte]
    model_name: str = ""
    machine: str = field(default_factory=lambda: f"{platform.node()}-{platform.machine()}")

    def prefill_s(self, tokens: int, context: int = 0) -> float:
        p0, p1, p2 = self.prefill
        return p0 + p1 * tokens + p2 * tokens * context

    def decode_s(self, batch: int, total_context: int) -> float:
        d0, d1, d2 = self.decode
        return d0 + d1 * batch + d2 * total_context

    def transfer_s(self, num_bytes: int) -> float:
        t0, per_byte = self.transfer
        return t0 + per_byte * num_bytes if num_bytes > 0 else 0.0

    @property
    def transfer_bandwidth(self) -> float:
        return 1.0 / self.transfer[1] if self.transfer[1] > 0 else float("inf")

    @classmethod
    def fit(
        cls,
        prefill_samples: list[tuple[int, int, float]],  # (tokens, context, seconds)
        decode_samples: list[tuple[int, int, float]],  # (batch, total_context, seconds)
        transfer_samples: list[tuple[int, float]],  # (bytes, seconds)
        model_name: str = "",
    ) -> LatencyModel:
        p = np.array(prefill_samples, np.float64)
        d = np.array(decode_samples, np.float64)
        t = np.array(transfer_samples, np.float64)
        prefill = fit_nonnegative(
            np.stack([np.ones(len(p)), p[:, 0], p[:, 0] * p[:, 1]], 1), p[:, 2])
        decode = fit_nonnegative(np.stack([np.ones(len(d)), d[:, 0], d[:, 1]], 1), d[:, 2])
        transfer = fit_nonnegative(np.stack([np.ones(len(t)), t[:, 0]], 1), t[:, 1])
        return cls(prefill.tolist(), decode.tolist(), transfer.tolist(), model_name)

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=2)

    @classmethod
    def load(cls, path: str) -> LatencyModel:
        try:
            with open(path) as f:
                raw = json.load(f)
            model = cls(**raw)
        except (OSError, json.JSONDecodeError, TypeError) as e:
            raise ValueError(f"latency profile {path!r} is unreadable: {e}") from e
        for name, n in (("prefill", 3), ("decode", 3), ("transfer", 2)):
            coef = getattr(model, name)
            if len(coef) != n or any(not np.isfinite(c) or c < 0 for c in coef):
                raise ValueError(f"latency profile {path!r}: {name} must be {n} finite "
                                 f"non-negative numbers, got {coef}")
        return model
