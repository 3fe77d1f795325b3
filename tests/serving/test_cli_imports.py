"""`superinfer serve` (and generate, batch) never import the measuring tools, and no
command imports `benchmarks` (not installed): `bench` and `simulate` load their tools, from
the package, when run."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = """
import sys
from serving.cli import build_parser
args = build_parser({command!r}).parse_args({argv!r})
tools = ("benchmarks", "serving.bench", "superinfer_jax.sim.cli")
loaded = sorted(m for m in sys.modules if m in tools or m.startswith(tuple(t + "." for t in tools)))
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
    simulate = _benchmark_modules("simulate", ["simulate"])
    bench = _benchmark_modules("bench", ["bench"])
    assert "superinfer_jax.sim.cli" in simulate and "serving.bench.cli" in bench
    assert not [m for m in simulate + bench if m.split(".")[0] == "benchmarks"]
