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


# CPU features that decide which native kernels run (and so the figures a run gives).
KERNEL_CPU_FLAGS = ("avx512f", "avx512_bf16", "avx512_vnni", "avx512vbmi", "amx_tile",
                    "amx_bf16", "amx_int8")


def cpu_description() -> dict[str, Any]:
    """The CPU's model name and its kernel-relevant flags (Linux's /proc/cpuinfo; empty
    elsewhere), and whether ``SUPERINFER_NATIVE_AMX=1`` asked for the AMX matmuls: the
    project's machines change model between sessions, and a figure is only comparable
    with one measured on the same CPU."""
    model = ""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return {"cpu_model": model or platform.processor(),
            "cpu_flags": [f for f in KERNEL_CPU_FLAGS if f in flags],
            "native_amx_requested": os.environ.get("SUPERINFER_NATIVE_AMX") == "1"}


def environment() -> dict[str, Any]:
    import jax

    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        **cpu_description(),
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
