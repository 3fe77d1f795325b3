"""The simulator's acceptance data built from a ``benchmarks.speculative`` result: each
request's per-token rate (accepted / (accepted + rejections)), per-kind pools, and the
rows that feed it (n-gram, fixed, the asked k, the four workloads)."""

from __future__ import annotations

import pytest

from benchmarks.lib import spec_acceptance


def _row(workload: str, k: int, counts: list[tuple[int, int, int]], mode: str = "fixed"
         ) -> dict:
    return {"method": "ngram", "mode": mode, "workload": workload, "batch": 1, "k": k,
            "acceptance_rate": 0.5, "speedup": 1.2,
            "per_request": [{"proposed": p, "accepted": a, "rejections": r,
                             "workload": workload} for p, a, r in counts]}


def test_per_request_rates_from_the_fixed_rows_at_k():
    result = {"dtype": "bfloat16", "max_tokens": 128, "rows": [
        _row("repeat", 3, [(30, 18, 2), (12, 0, 4)]),
        _row("chat", 3, [(9, 3, 3), (0, 0, 0)]),  # the second never got a proposal
        _row("chat", 1, [(5, 5, 0)]),  # another k: left out
        _row("chat", 3, [(9, 9, 0)], mode="slo"),  # mode slo: left out
        _row("grounded", 3, [(30, 18, 2), (12, 0, 4)])]}  # a sum of the kinds: left out
    data = spec_acceptance.build(result, 3, ["python", "-m", "benchmarks.speculative"],
                                 (1.0, 2.0))
    assert data["rates"] == [0.9, 0.0, 0.5]
    assert data["per_kind"]["repeat"]["per_token_rate"] == pytest.approx(18 / 24, abs=1e-4)
    assert data["per_kind"]["chat"]["without_proposals"] == 1
    assert set(data["per_kind"]) == {"repeat", "chat"}
    src = data["source"]
    assert src["k"] == 3 and src["dtype"] == "bfloat16" and src["max_tokens"] == 128
    assert src["command"] == "python -m benchmarks.speculative" and src["commit"]
    with pytest.raises(ValueError, match="no n-gram fixed rows at k=5"):
        spec_acceptance.build(result, 5, [], (0.0, 0.0))
