"""Speculation settings in the CPU policy sweep (``benchmarks.policy_sweep
--speculative``): the engines to compare and the summary per setting.

An engine variant is a policy, a speculation setting (``none``, or n-gram speculation
in mode ``fixed:K`` or ``slo:K``) and a ``max_num_seqs``. Every variant replays the
same requests (same seeds, same arrivals: the sweep's paired runs). The summary compares,
per ``max_num_seqs``, policy and rate, each setting with the ``none`` row (TBT and TTFT
attainment in points, throughput as a ratio) and with the best fixed ``k`` (throughput
ratio), pooled over the seeds and seed by seed; the issue's bar for mode ``slo``: TBT
attainment at least ``none``'s minus 1 point and output throughput at least 0.97x the
best fixed ``k``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TBT_POINTS_GOAL = -1.0  # slo: TBT attainment vs none, points
THROUGHPUT_GOAL = 0.97  # slo: output throughput vs the best fixed k


@dataclass(frozen=True)
class SpecSetting:
    """``none``, ``fixed:K`` or ``slo:K`` (n-gram proposals, at most ``K`` per row)."""

    mode: str = "none"
    k: int = 0

    @property
    def label(self) -> str:
        return "none" if self.mode == "none" else f"{self.mode}:{self.k}"

    def knobs(self) -> dict[str, Any]:
        """The ``EngineConfig.build`` keys of this setting."""
        if self.mode == "none":
            return {}
        return {"speculative_method": "ngram", "num_speculative_tokens": self.k,
                "speculative_mode": self.mode}


@dataclass(frozen=True)
class Variant:
    """One engine of the sweep; ``label`` names its rows."""

    label: str
    policy: str
    setting: SpecSetting
    max_num_seqs: int


def parse_settings(text: str) -> list[SpecSetting]:
    """``--speculative``: comma-separated ``none``, ``fixed:K``, ``slo:K`` (K >= 1)."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        if item == "none":
            out.append(SpecSetting())
            continue
        mode, sep, k = item.partition(":")
        if mode not in ("fixed", "slo") or not sep or not k.isdigit() or int(k) < 1:
            raise ValueError(f"--speculative: {item!r} is not none, fixed:K or slo:K "
                             f"with K an integer >= 1")
        out.append(SpecSetting(mode, int(k)))
    if not out:
        raise ValueError("--speculative: no setting given")
    return list(dict.fromkeys(out))


def parse_max_num_seqs(text: str) -> list[int]:
    """``--max-num-seqs``: comma-separated integers >= 1."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items or not all(x.isdigit() and int(x) >= 1 for x in items):
        raise ValueError(f"--max-num-seqs must be comma-separated integers >= 1, got "
                         f"{text!r}")
    return list(dict.fromkeys(int(x) for x in items))


def variants(policies: list[str], settings: list[SpecSetting] | None,
             max_num_seqs: list[int]) -> list[Variant]:
    """Every policy x setting x ``max_num_seqs``. Labels are the bare policy names
    without ``--speculative`` and with one ``max_num_seqs`` (the sweep as it was), else
    ``policy setting seqs=N`` with the parts that vary."""
    plain = settings is None
    settings = settings or [SpecSetting()]
    out = []
    for n in max_num_seqs:
        for policy in policies:
            for s in settings:
                parts = [policy] if len(policies) > 1 or plain else []
                parts += [] if plain else [s.label]
                parts += [f"seqs={n}"] if len(max_num_seqs) > 1 else []
                out.append(Variant(" ".join(parts), policy, s, n))
    return out


def spec_counters(engine: Any) -> tuple[int, int, int]:
    """(drafts, proposed, accepted) so far: the engine's ``spec_decode`` counters."""
    spec = engine.stats().spec_decode
    return (0, 0, 0) if spec is None else (spec.num_drafts, spec.num_draft_tokens,
                                           spec.num_accepted_tokens)


def columns(variant: Variant, results: list[dict[str, Any]], seeds: list[int],
            summarize: Any) -> dict[str, Any]:
    """A pooled row's speculation columns: the variant, its acceptance rate over the
    seeds' runs, and each seed's own attainment and throughput (for the paired
    comparison)."""
    proposed = sum(r.get("spec", (0, 0, 0))[1] for r in results)
    accepted = sum(r.get("spec", (0, 0, 0))[2] for r in results)
    per_seed = []
    for seed, r in zip(seeds, results, strict=True):
        s = summarize(r["timelines"], r["duration"])
        per_seed.append({"seed": seed, "ttft_att": s["ttft_attainment"],
                         "tbt_att": s["tbt_attainment"], "out_tok_s": s["output_throughput"]})
    return {"base_policy": variant.policy, "speculative": variant.setting.label,
            "max_num_seqs": variant.max_num_seqs,
            "acceptance": accepted / proposed if proposed else 0.0, "per_seed": per_seed}


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (max_num_seqs, policy, rate): each setting against ``none`` and the best
    fixed ``k``, pooled and per seed, and whether mode ``slo`` meets the bar."""
    groups: dict[tuple[int, str, float], dict[str, dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["max_num_seqs"], r["base_policy"], r["rate"]),
                          {})[r["speculative"]] = r
    table, checks = [], []
    for (seqs, policy, rate), by in sorted(groups.items()):
        none = by.get("none")
        fixed = [r for name, r in by.items() if name.startswith("fixed:")]
        best = max(fixed, key=lambda r: r["out_tok_s"]) if fixed else None
        for name, r in by.items():
            line = {"max_num_seqs": seqs, "policy": policy, "rate": rate, "speculative": name,
                    "ttft_att": r["ttft_att"], "tbt_att": r["tbt_att"],
                    "out_tok_s": r["out_tok_s"], "acceptance": r["acceptance"]}
            if none is not None:
                line |= _against_none(r, none)
            if best is not None:
                line["best_fixed"] = best["speculative"]
                line["tput_vs_best_fixed"] = r["out_tok_s"] / max(best["out_tok_s"], 1e-9)
                line["seed_tput_vs_best_fixed"] = [
                    a["out_tok_s"] / max(b["out_tok_s"], 1e-9)
                    for a, b in zip(r["per_seed"], best["per_seed"], strict=True)]
            if name.startswith("slo:") and none is not None and best is not None:
                line["met"] = (line["tbt_pts_vs_none"] >= TBT_POINTS_GOAL
                               and line["tput_vs_best_fixed"] >= THROUGHPUT_GOAL)
                checks.append(line)
            table.append(line)
    met = bool(checks) and all(c["met"] for c in checks)
    text = (f"slo vs none (TBT attainment, goal >= {TBT_POINTS_GOAL:+g} points) and vs the "
            f"best fixed k (output throughput, goal >= {THROUGHPUT_GOAL}x): "
            + ("; ".join(f"seqs={c['max_num_seqs']} {c['policy']} @ {c['rate']:g} "
                         f"{c['speculative']}: {c['tbt_pts_vs_none']:+.1f} points, "
                         f"{c['tput_vs_best_fixed']:.3f}x {c['best_fixed']}"
                         for c in checks) or "no slo row with a none and a fixed row")
            + f": {'met' if met else 'NOT met'}")
    return {"rows": table, "met": met, "text": text}


def _against_none(r: dict[str, Any], none: dict[str, Any]) -> dict[str, Any]:
    """Attainment in points and throughput as a ratio against the ``none`` row, pooled
    and per seed (the same seed's arrivals on both)."""
    return {
        "tbt_pts_vs_none": 100 * (r["tbt_att"] - none["tbt_att"]),
        "ttft_pts_vs_none": 100 * (r["ttft_att"] - none["ttft_att"]),
        "tput_vs_none": r["out_tok_s"] / max(none["out_tok_s"], 1e-9),
        "seed_tbt_pts_vs_none": [100 * (a["tbt_att"] - b["tbt_att"])
                                 for a, b in zip(r["per_seed"], none["per_seed"],
                                                 strict=True)]}
