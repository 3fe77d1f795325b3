"""The scheduler, KV manager and simulator (``MODULES``) compiled to C with mypyc, for
paper-scale simulations; plain Python unless a build for the exact source exists.

Build (opt-in, needs mypy and a C compiler): ``python -m superinfer_jax.mypyc_build``.
The build goes under ``$SUPERINFER_COMPILED_CACHE`` in a folder named by a hash of the
package's ``.py`` files and the Python version; importing ``superinfer_jax`` installs
an import finder for it, so an edited tree runs as Python. ``SUPERINFER_COMPILED=0``
turns it off (the test suite does: its hooks on instances fail when compiled).

Where compiled code differs, and what the code base does about it:
- NATIVE_INIT: a compiled dataclass's generated ``__init__`` is interpreted, so hot
  dataclasses write theirs out (not frozen, never changed once made);
- the truth of a native object ignores ``__len__``: classes with one define ``__bool__``;
- a ``float`` is a C double, so fields holding exact ints say ``int | float``;
- methods cannot be replaced on an instance, and no attribute beyond those declared;
- a compiled dataclass type-checks its fields, so ``SamplingParams`` (whose errors name
  the field) is a plain class (``mypyc_attr(native_class=False)``);
- a decorated class is plain Python, which a native class cannot extend: built-in
  policies are registered after their definitions, and open to interpreted subclasses.
Measurements: docs/results/simulator.md.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import sysconfig
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import TypeVar

from superinfer_jax.local_cache import cache_root, switched_on

_C = TypeVar("_C")

# ``mypyc_attr`` for the compiled modules; without mypy_extensions (serving-only
# installs) nothing is compiled and it leaves the class as it is.
try:
    from mypy_extensions import mypyc_attr
except ImportError:  # pragma: no cover - serving-only installs
    def mypyc_attr(*attrs: str, **kwattrs: object) -> Callable[[_C], _C]:
        return lambda cls: cls

MODULES = (
    "superinfer_jax.request",  # with the simulator: its SimRequest extends Request
    "superinfer_jax.sched.waiting_queue",
    "superinfer_jax.sched.step_plan",
    "superinfer_jax.sched.prefix_planner",
    "superinfer_jax.sched.selection",  # reads every runner of every contended step
    "superinfer_jax.sched.scheduler",
    "superinfer_jax.kv.page_allocator",
    "superinfer_jax.kv.prefix_cache",
    "superinfer_jax.kv.host_cache",
    "superinfer_jax.kv.host_tier",
    "superinfer_jax.kv.two_tier",
    "superinfer_jax.sched.rotasched.lag",
    "superinfer_jax.sched.rotasched.ranking",
    "superinfer_jax.sched.rotasched.policy",  # open to interpreted subclasses (plug-ins)
    "superinfer_jax.sched.rotasched.policies",
    "superinfer_jax.sched.latency",  # priced every step by the policies (rotate-ins, budgets)
    "superinfer_jax.sim.cost_model",  # the roofline, priced every simulated step
    "superinfer_jax.sim.cost",
    "superinfer_jax.sim.request_specs",
    "superinfer_jax.sim.simulator",
)
_SWITCH_ENV = "SUPERINFER_COMPILED"
_CACHE_ENV = "SUPERINFER_COMPILED_CACHE"
PACKAGE_DIR = Path(__file__).resolve().parent.parent  # superinfer_jax/
_SUFFIX = sysconfig.get_config_var("EXT_SUFFIX") or ".so"

_active: Path | None = None


def enabled() -> bool:
    """False when ``SUPERINFER_COMPILED`` is ``0``, ``false``, ``no`` or ``off``."""
    return switched_on(_SWITCH_ENV)


def source_key() -> str:
    """A hash of every ``.py`` file of the package (paths and contents) and the Python."""
    h = hashlib.sha256(sys.version.encode())
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        h.update(str(path.relative_to(PACKAGE_DIR)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:20]


def build_dir() -> Path:
    root = Path(os.environ.get(_CACHE_ENV) or cache_root() / "compiled")
    return root / source_key()


def _module_file(root: Path, name: str) -> Path:
    return root.joinpath(*name.split(".")).with_name(name.rsplit(".", 1)[-1] + _SUFFIX)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``MODULES`` (and mypyc's shared library beside them) in one build folder."""

    def __init__(self, root: Path):
        self.root = root

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname in MODULES:
            file = _module_file(self.root, fullname)
        elif fullname.endswith("__mypyc") and "." not in fullname:
            file = self.root / (fullname + _SUFFIX)
        else:
            return None
        if not file.exists():
            return None
        loader = importlib.machinery.ExtensionFileLoader(fullname, str(file))
        return importlib.util.spec_from_file_location(fullname, file, loader=loader)


def install() -> Path | None:
    """Use the build for this source, if any and nothing is imported yet; its folder."""
    global _active
    if _active is not None or not enabled():
        return _active
    try:
        root = build_dir()
        complete = (root / "COMPLETE").exists()
    except OSError:
        return None
    if not complete or any(name in sys.modules for name in MODULES):
        return None
    sys.meta_path.insert(0, _Finder(root))
    _active = root
    return root


def active() -> Path | None:
    """The build folder in use, or None when these modules run as plain Python."""
    return _active


def build() -> Path:
    """Compile ``MODULES`` with mypyc into ``build_dir()``; returns it (existing: as is)."""
    import shutil
    import tempfile

    target = build_dir()
    if (target / "COMPLETE").exists():
        return target
    from mypyc.build import mypycify
    from setuptools import setup

    repo = PACKAGE_DIR.parent
    paths = [str(Path(*name.split(".")).with_suffix(".py")) for name in MODULES]
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + "-", dir=target.parent))
    cwd = os.getcwd()
    try:
        os.chdir(repo)  # mypyc names modules by their paths from here
        with tempfile.TemporaryDirectory() as tmp:
            extensions = mypycify(paths, opt_level="3", target_dir=str(Path(tmp) / "c"))
            setup(name="superinfer-jax-compiled", ext_modules=extensions,
                  script_args=["--quiet", "build_ext", "--build-lib", str(staging),
                               "--build-temp", str(Path(tmp) / "o")])
        (staging / "COMPLETE").write_text(" ".join(MODULES) + "\n")
        if target.exists():  # another builder finished first: keep theirs
            shutil.rmtree(staging)
        else:
            os.replace(staging, target)
    finally:
        os.chdir(cwd)
        if staging.exists() and staging != target:
            shutil.rmtree(staging, ignore_errors=True)
    return target


install()  # on import: ``superinfer_jax/__init__.py`` imports this module first
