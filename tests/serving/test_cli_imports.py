"""`superinfer serve` (and generate, batch) never import benchmark code: a serving install
needs only the package, while `bench` and `simulate` load their tools when run."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = """
import sys
from serving.cli import build_parser
args = build_parser({command!r}).parse_args({argv!r})
loaded = sorted(m for m in sys.modules if m == "benchmarks" or m.startswith("benchmarks."))
print(",".join(loaded))
"""


def _benchmark_modules(command: str, argv: list[str]) -> list[str]:
    out = subprocess.run([sys.executable, "-c", CHECK.format(command=command, argv=argv)],
                         capture_output=True, text=True, check=True).stdout.strip()
    return [m for m in out.split(",") if m]


@pytest.mark.parametrize("argv", [["serve"], ["generate", "hi"], ["config"]])
def test_serving_commands_do_not_import_benchmarks(argv):
    assert _benchmark_modules(argv[0], argv) == []


def test_bench_and_simulate_load_their_tool():
    assert "benchmarks.simulate" in _benchmark_modules("simulate", ["simulate"])
    assert "benchmarks.serve_bench" in _benchmark_modules("bench", ["bench"])
