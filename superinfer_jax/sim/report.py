"""Results of the simulator and the benchmarks: a plain-text table, JSON with the machine's
context (time, platform, JAX backend and devices)."""

from __future__ import annotations

import json
import os
import platform
import time
from typing import Any


def print_table(rows: list[dict[str, Any]], title: str | None = None) -> None:
    if not rows:
        print("(no rows)")
        return
    cols = list(rows[0])
    for r in rows[1:]:
        cols += [c for c in r if c not in cols]
    cells = [[_fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    if title:
        print(f"\n{title}")
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def environment() -> dict[str, Any]:
    import jax

    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
    }


def write_json(path: str, payload: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    payload = {"environment": environment(), **payload}
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)
    print(f"\nwrote {path}")
