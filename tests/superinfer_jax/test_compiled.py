"""The mypyc build is used exactly when it matches the source, and only for its modules."""

from __future__ import annotations

import importlib
import sys

import pytest

import superinfer_jax.mypyc_build as compiled


def test_compiled_modules_are_in_use_exactly_when_a_matching_build_exists():
    """Where a build matches this source and is switched on, the listed modules are the
    compiled ones; otherwise (an edited tree, or the suite's default
    ``SUPERINFER_COMPILED=0``) every one is plain Python."""
    built = compiled.enabled() and (compiled.build_dir() / "COMPLETE").exists()
    assert (compiled.active() is not None) == built
    for name in compiled.MODULES:
        module = importlib.import_module(name)
        assert module.__file__ is not None
        assert module.__file__.endswith(".py") != built, (name, module.__file__)
    for name in ("superinfer_jax.engine", "superinfer_jax.sched.rotasched.registry"):
        assert importlib.import_module(name).__file__.endswith(".py")


def test_finder_serves_only_the_listed_modules(tmp_path):
    finder = compiled._Finder(tmp_path)
    name = "superinfer_jax.kv.two_tier"
    assert finder.find_spec(name) is None  # no file in the build folder: not ours
    path = compiled._module_file(tmp_path, name)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"")
    spec = finder.find_spec(name)
    assert spec is not None and spec.origin == str(path)
    assert finder.find_spec("superinfer_jax.engine") is None
    (tmp_path / ("abc__mypyc" + compiled._SUFFIX)).write_bytes(b"")
    assert finder.find_spec("abc__mypyc") is not None  # mypyc's shared library
    assert finder.find_spec("pkg.abc__mypyc") is None


def test_the_key_follows_every_source_file(tmp_path, monkeypatch):
    (tmp_path / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(compiled, "PACKAGE_DIR", tmp_path)
    before = compiled.source_key()
    assert compiled.source_key() == before
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    assert compiled.source_key() != before


def test_the_key_and_the_build_read_the_package_itself():
    """The hashed tree is superinfer_jax/ (every module ``MODULES`` compiles is in it),
    and the build's paths, relative to its parent, name those modules' files."""
    assert compiled.PACKAGE_DIR.name == "superinfer_jax"
    for name in compiled.MODULES:
        assert (compiled.PACKAGE_DIR.parent / (name.replace(".", "/") + ".py")).is_file(), name


def test_build_dir_follows_the_cache_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("SUPERINFER_COMPILED_CACHE", str(tmp_path))
    assert compiled.build_dir().parent == tmp_path


@pytest.mark.parametrize("value,want", [("0", False), ("off", False), ("1", True), ("", True)])
def test_switch_parses(monkeypatch, value, want):
    monkeypatch.setenv("SUPERINFER_COMPILED", value)
    assert compiled.enabled() is want


def test_plain_python_subprocess_when_switched_off(tmp_path):
    import subprocess

    code = ("import superinfer_jax.sched.scheduler as s; "
            "import superinfer_jax.mypyc_build as compiled; "
            "print(s.__file__, compiled.active())")
    env = {"SUPERINFER_COMPILED": "0", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
           "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    assert out[0].endswith("scheduler.py") and out[1] == "None"
