"""Per-request acceptance rates from a speculative benchmark run, and the simulator's
``measured`` acceptance data built from them.

A request's counters (``Request.num_spec_*``): guesses proposed, guesses accepted, and
rejections (verifications that refused a guess). Its per-token acceptance rate is
``accepted / (accepted + rejections)``: the maximum-likelihood rate of the simulator's
model, where each guess is accepted with the request's rate until the first rejection
(``superinfer_jax.sim.speculation``), and the mean the engine's own estimator
(``sched.speculation.AcceptanceEstimator``) converges to. ``accepted / proposed`` (the
benchmark rows' ``acceptance_rate``) is lower for the same request: guesses after a
rejection count as proposed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

from benchmarks.lib.common import write_json

KINDS = ("repeat", "edit", "quote", "chat")  # the workloads whose requests feed the data
DATA_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "superinfer_jax", "sim",
                         "data", "ngram_acceptance.json")


def request_counts(req: Any) -> dict[str, int]:
    """One finished request's speculation counters."""
    return {"proposed": int(req.num_spec_proposed), "accepted": int(req.num_spec_accepted),
            "rejections": int(req.num_spec_rejections)}


def per_token_rate(accepted: int, rejections: int) -> float | None:
    """``accepted / (accepted + rejections)``; None when nothing was verified."""
    seen = accepted + rejections
    return accepted / seen if seen else None


def build(result: dict[str, Any], k: int, command: list[str], load: tuple[float, float]
          ) -> dict[str, Any]:
    """The simulator's acceptance data from a ``benchmarks.speculative`` JSON: every
    request's per-token rate from the n-gram ``fixed`` rows at ``k`` of the four
    workloads (requests that never got a proposal are counted, not drawn from), each
    workload's pooled rate, and how the run was made (``load``: the 1-minute load
    average at its start and end)."""
    rows = [r for r in result["rows"] if r["method"] == "ngram" and r["mode"] == "fixed"
            and r["k"] == k and r["workload"] in KINDS]
    if not rows:
        raise ValueError(f"no n-gram fixed rows at k={k} in the run")
    rates: list[float] = []
    per_kind: dict[str, dict[str, Any]] = {}
    for row in rows:
        counts = row["per_request"]
        got = [per_token_rate(c["accepted"], c["rejections"]) for c in counts]
        kept = [round(a, 4) for a in got if a is not None]
        rates += kept
        accepted = sum(c["accepted"] for c in counts)
        rejections = sum(c["rejections"] for c in counts)
        key = row["workload"] if len(set(r["batch"] for r in rows)) == 1 \
            else f"{row['workload']}@{row['batch']}"
        per_kind[key] = {
            "requests": len(counts), "without_proposals": len(counts) - len(kept),
            "per_token_rate": round(per_token_rate(accepted, rejections) or 0.0, 4),
            "accepted_per_proposed": row["acceptance_rate"], "speedup": row["speedup"],
            "rates": kept}
    return {
        "description": "per-request per-token acceptance rates of n-gram speculation "
                       "(accepted / (accepted + rejections)), the simulator's `measured` "
                       "acceptance model: each simulated request draws one uniformly",
        "rates": rates, "per_kind": per_kind,
        "source": {"command": " ".join(command), "commit": _commit(), "k": k,
                   "dtype": result.get("dtype"), "max_tokens": result.get("max_tokens"),
                   "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   "load_average_start_end": [round(x, 2) for x in load],
                   "note": "greedy acceptance does not depend on the machine's load "
                           "(only the rows' tok/s do)"}}


def write(path: str, result: dict[str, Any], k: int, load: tuple[float, float]) -> None:
    data = build(result, k, [sys.executable.rsplit("/", 1)[-1], "-m",
                             "benchmarks.speculative", *sys.argv[1:]], load)
    write_json(path, data)
    print(f"wrote {path}: {len(data['rates'])} per-request rates")


def _commit() -> str:
    """HEAD, with ``+dirty`` when tracked files differ from it."""
    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], capture_output=True, text=True,
                              check=False).stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
