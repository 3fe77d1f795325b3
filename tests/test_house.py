"""The house's limits (issue 43), measured by ``benchmarks.house`` (its docstring defines
each measure): prose at most 18% of ``superinfer_jax/``; at most 15 comment or docstring
lines carrying measurement history and none naming a session, in ``superinfer_jax/``,
``models/`` and ``serving/``; at most 12 modules at the root of ``superinfer_jax/``; no
import cycle; outside ``superinfer_jax/ops/`` no module over 600 lines, no class over 450,
no function over 80. Then the cycle finder itself, on a small synthetic graph.

``python -m benchmarks.house --list`` prints every measure and every offending line.
"""

from __future__ import annotations

import ast

import pytest

from benchmarks import house

MAX_PROSE_SHARE = 0.18
MAX_HISTORY_LINES = 15
MAX_ROOT_MODULES = 12
MAX_MODULE_LINES, MAX_CLASS_LINES, MAX_FUNCTION_LINES = 600, 450, 80


@pytest.fixture(scope="module")
def report() -> house.HouseReport:
    return house.measure()


def test_prose_is_at_most_18_percent_of_the_engine(report):
    engine = next(t for t in report.prose if t.package == "superinfer_jax")
    assert engine.share <= MAX_PROSE_SHARE, (
        f"prose is {engine.share:.1%} of superinfer_jax/ ({engine.prose_lines} of "
        f"{engine.lines} lines)")


def test_little_measurement_history_in_comments(report):
    assert len(report.history_lines) <= MAX_HISTORY_LINES, "\n".join(report.history_lines)


def test_no_comment_names_a_session(report):
    assert report.session_lines == [], "\n".join(report.session_lines)


def test_at_most_12_modules_at_the_package_root(report):
    assert report.root_modules <= MAX_ROOT_MODULES


def test_no_import_cycles(report):
    assert report.cycles == [], "\n".join(" ".join(cycle) for cycle in report.cycles)


def test_no_module_class_or_function_over_its_size_outside_ops(report):
    over = house.sizes_over(report, MAX_MODULE_LINES, MAX_CLASS_LINES, MAX_FUNCTION_LINES)
    assert over == [], "\n".join(f"{o.kind} {o.where}: {o.lines} lines" for o in over)


# -- the cycle finder ----------------------------------------------------------------------

SYNTHETIC = {
    # a and b: a cycle through ``from P import X`` (X a module, then a name in a module)
    "p": (True, ""),
    "p.a": (False, "from p import b\n"),
    "p.b": (False, "from p.a import thing\n"),
    # c imports d for type checking only: no edge, so no cycle; d imports c
    "p.c": (False, "from typing import TYPE_CHECKING\n"
                   "if TYPE_CHECKING:\n    from p.d import D\n"),
    "p.d": (False, "import p.c\n"),
    # typing.TYPE_CHECKING's else branch runs: it counts
    "p.i": (False, "import typing\n"
                   "if typing.TYPE_CHECKING:\n    pass\nelse:\n    from p.j import J\n"),
    "p.j": (False, "from p.i import I\n"),
    # e imports f inside a function: it counts
    "p.e": (False, "def load():\n    from p.f import x\n    return x\n"),
    "p.f": (False, "from p.e import load\n"),
    # relative imports resolve against the module's package
    "p.g": (False, "from .h import z\n"),
    "p.h": (False, "from . import g\n"),
    # a chain, not a cycle: q.x -> q.y -> q.z; and an import of a module outside the graph
    "q": (True, "import os\n"),
    "q.x": (False, "from q.y import y\n"),
    "q.y": (False, "from q import z\n"),
    "q.z": (False, "import json\n"),
}


def _graph() -> dict[str, set[str]]:
    known = set(SYNTHETIC)
    return {name: house.import_edges(name, is_package, ast.parse(source), known)
            for name, (is_package, source) in SYNTHETIC.items()}


def test_edges_follow_the_definition():
    graph = _graph()
    assert graph["p.a"] == {"p", "p.b"}  # from P import X: P.X (a module) and P
    assert graph["p.b"] == {"p.a"}  # P.X not a module: P alone
    assert graph["p.c"] == set()  # TYPE_CHECKING only
    assert graph["p.e"] == {"p.f"}  # inside a function
    assert graph["p.h"] == {"p", "p.g"}  # relative, resolved
    assert graph["q"] == set()  # outside the graph
    assert graph["q.y"] == {"q", "q.z"}


def test_cycles_are_the_strongly_connected_components():
    cycles = house.find_cycles(_graph())
    assert sorted(cycles) == [["p.a", "p.b"], ["p.e", "p.f"], ["p.g", "p.h"],
                              ["p.i", "p.j"]]
    assert house.find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
        ["a", "b", "c"]]
    assert house.find_cycles({"a": {"b"}, "b": set()}) == []
