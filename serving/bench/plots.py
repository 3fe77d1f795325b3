"""Plots of the serving benchmark: latency CDFs per run, attainment against rate."""

from __future__ import annotations

import os
from typing import Any

import numpy as np


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(row: dict[str, Any]) -> str:
    rate = "inf" if row["rate"] == float("inf") else f"{row['rate']:g}"
    return f"{row['policy'] or 'server'} @ {rate}/s"


def latency_cdfs(rows: list[dict[str, Any]], path: str) -> None:
    """TTFT, inter-token latency and end-to-end latency CDFs, one line per run."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for row in rows:
        res = row["result"]
        ok = [i for i, n in enumerate(res["output_lens"]) if n > 0]
        series = (
            [res["ttfts"][i] for i in ok],
            [g for i in ok for g in res["itls"][i]],
            [res["ttfts"][i] + sum(res["itls"][i]) for i in ok],
        )
        for ax, values in zip(axes, series, strict=True):
            if values:
                v = np.sort(np.asarray(values) * 1000)
                ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=_label(row))
    for ax, name in zip(axes, ("TTFT", "inter-token latency", "end-to-end latency"),
                        strict=True):
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("CDF")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=7)
    _save(fig, plt, path)


def attainment_vs_rate(rows: list[dict[str, Any]], path: str) -> None:
    plt = _pyplot()
    keys = (("ttft_att", "TTFT SLO attainment"), ("tbt_att", "TBT SLO attainment (gaps)"),
            ("slo_att", "both SLOs (requests)"))
    fig, axes = plt.subplots(1, len(keys), figsize=(14, 4))
    for ax, (key, title) in zip(axes, keys, strict=True):
        for policy in dict.fromkeys(r["policy"] for r in rows):
            pts = sorted((r["rate"], r[key]) for r in rows if r["policy"] == policy)
            ax.plot(*zip(*pts, strict=True), marker="o", label=policy or "server")
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(title, fontsize=9)
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    _save(fig, plt, path)


def _save(fig, plt, path: str) -> None:
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
