"""The scheduler, KV manager and simulator compiled to C with mypyc, used only when they
match the source exactly.

Why: RotaSched's host work is Python (ranking, rotation bookkeeping, page tables), and a
paper-scale simulation runs it for 100k requests. mypyc compiles these typed modules as
they are, with no change to what they compute: measured with ``benchmarks.sim_speed
--baseline-plain`` (knee, 20k requests, a 2-core AMD EPYC box, idle) rotasched took
13.0 s against 36.8 s as plain Python (fcfs 2.1 against 6.0 s), and the seeded
simulator outputs of ``benchmarks.plan_trace --outputs-only`` hash the same
as plain Python's on all 7 cases.

Build, opt-in: ``python -m superinfer_jax.mypyc_build`` (``make compiled``; it needs
mypy, from the dev extra, and a C compiler: about 5 minutes on 2 cores). It is for
simulations (``superinfer simulate``, ``benchmarks.sim_speed``); ``make install`` does not
build it, so serving runs the modules as Python unless a build exists. Why opt-in: under a
build, the tests that hook instances fail (below), so the test suite turns it off
(``tests/conftest.py``) unless ``SUPERINFER_COMPILED`` is set. The result goes
under ``$SUPERINFER_COMPILED_CACHE`` (default ``~/.cache/superinfer_jax/mypyc_build``), in a
folder named by a hash of every ``.py`` file of this package and the Python version.

Use: importing ``superinfer_jax`` calls ``install()``, which puts an import finder in
front for exactly ``MODULES`` when a build for the current hash exists. Any edit to the
package changes the hash, so an edited tree runs as plain Python until it is rebuilt:
a stale compiled module is never imported. ``SUPERINFER_COMPILED=0`` turns it off.

Where compiled code differs from Python, and what this code base does about it:
- NATIVE_INIT: a compiled dataclass's generated ``__init__`` is an interpreted function
  (the ``dataclasses`` module writes it at import), called through ``slot_tp_init``:
  1,600 instructions to make a ``PageMoves``, 9,000 a frozen ``CallShape`` (callgrind,
  a 2,000-request knee simulation, where they were 6% of all instructions). The
  dataclasses made every simulated step write their ``__init__`` out, which mypyc
  compiles (84 against 220 ns for a four-field class); ``repr``, equality and
  ``dataclasses.replace`` are still the generated ones. Frozen ones are not frozen
  (a frozen ``__init__`` sets each field through ``object.__setattr__``), and never
  changed once made;
- the truth of a compiled object ignores ``__len__`` (``if cache:`` is ``cache is not
  None``): found by the prefix-cache state-machine test (``HostCache.evict`` on an empty
  heap); classes with ``__len__`` define ``__bool__``, and tests of emptiness say so;
- a value typed ``float`` is a C double when compiled, so an int there is converted
  (``2**64 - 1`` becomes ``2**64``): found by the gRPC seed-bound test; fields that hold
  exact ints say ``int | float``;
- compiled classes take no instance attributes beyond those declared, cannot be
  subclassed by interpreted classes, and their methods cannot be replaced on an instance
  (``AttributeError: ... is read-only``; compiled callers would not see it anyway): the
  tests that hook ``Scheduler.schedule``, ``Scheduler._run_rows`` or
  ``TwoTierKVManager.page_table`` on an instance fail under a build, and ``plan_trace``
  needs plain Python for its step trace;
- a compiled dataclass type-checks its fields in ``__init__``: ``SamplingParams(
  max_tokens="7")`` raised ``TypeError``, not the ``FieldError`` naming the field that the
  API promises, so ``SamplingParams`` is a plain Python class (``mypyc_attr(native_class=
  False)``) inside the compiled module;
- a class with a decorator is compiled as a plain Python class, which a native class
  cannot extend ("Non-extension classes may not inherit from extension classes"): the
  built-in policies are registered after their definitions, not by ``@register_policy``;
- a native class is closed to interpreted subclasses unless it is marked
  ``mypyc_attr(allow_interpreted_subclasses=True)``, as every built-in policy is (plug-ins
  and tests subclass them).
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

# The compiled modules' class options (``mypyc_attr``), from here, for every module: where
# mypy_extensions is missing (it comes with mypy, the dev extra; serving-only installs
# lack it) nothing is compiled, and the decorator leaves the class as it is.
try:
    from mypy_extensions import mypyc_attr
except ImportError:  # pragma: no cover - serving-only installs
    def mypyc_attr(*attrs: str, **kwattrs: object) -> Callable[[_C], _C]:
        return lambda cls: cls

MODULES = (
    "superinfer_jax.request",  # with the simulator: its SimRequest extends Request
    "superinfer_jax.sched.waiting_queue",
    "superinfer_jax.sched.step_plan",
    "superinfer_jax.sched.scheduler",
    "superinfer_jax.kv.page_allocator",
    "superinfer_jax.kv.prefix_cache",
    "superinfer_jax.kv.host_cache",
    "superinfer_jax.kv.two_tier",
    "superinfer_jax.sched.rotasched.lag",
    "superinfer_jax.sched.rotasched.ranking",
    "superinfer_jax.sched.rotasched.policy",  # open to interpreted subclasses (plug-ins)
    "superinfer_jax.sched.rotasched.policies",
    "superinfer_jax.sched.latency",  # priced every step by the policies (rotate-ins, budgets)
    "superinfer_jax.sim.cost_model",  # the roofline, priced every simulated step
    "superinfer_jax.sim.cost",
    "superinfer_jax.sim.simulator",
)
_SWITCH_ENV = "SUPERINFER_COMPILED"
_CACHE_ENV = "SUPERINFER_COMPILED_CACHE"
PACKAGE_DIR = Path(__file__).resolve().parent
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
    """Use the build for this source, if there is one and nothing is imported yet; returns
    its folder, or None (plain Python)."""
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
