"""Serialized-executable cache: a warm start loads each compiled program instead of
tracing, lowering and looking it up in XLA's persistent cache.

XLA's persistent cache is keyed by the lowered program, so even a hit pays JAX's tracing
and lowering first. This cache is keyed by what *determines* the program, computed
without tracing: JAX and jaxlib, the backend and its devices (the CPU's instruction-set
flags on CPU), ``XLA_FLAGS``, the source of the packages the step is written in, the
runner's ``context`` (everything the traced function closes over), the program's name
and its arguments' tree, shapes, dtypes and placements. A hit is one
``deserialize_and_load``. An unusable entry costs a warning naming the file, and the
program is compiled as before; writing is best effort, through a temporary file renamed.

Loading an executable runs code from the cache directory: it must be as trusted as the
XLA cache beside it (``hardware.compilation_cache_dir``).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import random
import tempfile
import threading
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from superinfer_jax.config import EngineConfig
from superinfer_jax.ops import native

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
SUBDIR = "superinfer-executables"
# Packages whose source the compiled programs are written in: any edit changes every key.
SOURCE_PACKAGES = ("superinfer_jax", "models")
# An XLA option only debug printing reads, part of XLA's cache key: ``refill`` sets it.
BYPASS_OPTION = "xla_debug_buffer_assignment_show_max"


class ExecutableCache:
    """Compiled programs on disk under ``directory``, for one ``context`` (see the module
    docstring: what the traced functions close over, as text)."""

    def __init__(self, directory: str, context: str):
        self.directory = directory
        self.context = context
        # programs XLA's cache served, to compile for real later (``refill``)
        self._pending: list[tuple[str, str, Callable[[], Any]]] = []
        self._lock = threading.Lock()
        self.num_loaded = 0  # programs this process loaded from the cache

    @classmethod
    def for_runner(cls, config: EngineConfig, model: Any, backend: str, feedback_width: int,
                   params_treedef: Any, mesh: Any) -> ExecutableCache | None:
        """The cache of a ``ModelRunner``'s programs, keyed also by what they close over
        (engine config, model, backend, weights' tree, mesh). None without a cache
        directory, and for a multi-process group (not validated there)."""
        if not config.hardware.compilation_cache_dir or jax.process_count() > 1:
            return None
        context = {
            "engine": config.replace(compilation_cache_dir=None, show_progress=True,
                                     warmup=True, compile_in_background=False, seed=0),
            "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
            "model": describe(model),
            "backend": backend,
            "feedback_width": feedback_width,
            "params": str(params_treedef),
            "mesh": repr(mesh),
        }
        return cls.under(config.hardware.compilation_cache_dir, context)

    @classmethod
    def under(cls, cache_dir: str, context: Mapping[str, Any]) -> ExecutableCache:
        """The cache in ``cache_dir``'s executables subdirectory, for ``context`` (each
        value's ``repr`` is part of every key)."""
        text = "\n".join(f"{k}={v!r}" for k, v in sorted(context.items()))
        return cls(os.path.join(os.path.expanduser(cache_dir), SUBDIR), text)

    def key(self, name: str, args: tuple) -> str:
        """The entry's key: a hash of the environment, the context, ``name`` and the
        signature of ``args`` (abstract values will do)."""
        h = hashlib.sha256()
        for part in (str(FORMAT_VERSION), environment_fingerprint(), self.context, name,
                     signature(args)):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()

    def path(self, key: str) -> Path:
        return Path(self.directory) / f"{key[:40]}.exe"

    def get_or_compile(self, name: str, args: tuple, lower: Callable[[], Any]) -> Any:
        """The executable of ``name`` at ``args``: loaded when a valid entry exists, else
        ``lower().compile()``, stored for the next start."""
        key = self.key(name, args)
        executable = self.load(key, args)
        if executable is not None:
            log.debug("executable cache hit: %s", name)
            with self._lock:
                self.num_loaded += 1
            return executable
        _listen_for_xla_cache_hits()
        _thread.xla_cache_hit = False
        compiled = lower().compile()
        if _thread.xla_cache_hit:
            # XLA:CPU serializes an executable it loaded from its own cache without its
            # fused kernels (the copy fails at its first run): ``refill`` compiles it
            log.debug("executable cache: %s came from XLA's cache; refilled later", name)
            with self._lock:
                self._pending.append((key, name, lower))
        else:
            self.store(key, compiled)
        return compiled

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def refill(self, keys: Collection[str] | None = None,
               stop: Callable[[], bool] = lambda: False) -> int:
        """Compile for real, and store, the programs XLA's persistent cache served since
        the last call (only those of ``keys`` when given); returns how many were stored.
        A random value of a debug-only option makes XLA's cache miss, so each is a full
        compile: run it in the background. ``stop`` is asked before each compile."""
        stored = 0
        while True:
            with self._lock:
                if not self._pending or stop():
                    return stored
                key, name, lower = self._pending.pop(0)
            if keys is not None and key not in keys:
                continue
            _listen_for_xla_cache_hits()
            _thread.xla_cache_hit = False
            options = {BYPASS_OPTION: random.randrange(1, 2**31)}
            compiled = lower().compile(compiler_options=options)
            if _thread.xla_cache_hit:
                log.warning("executable cache: XLA's cache served %s again; not stored", name)
                continue
            stored += self.store(key, compiled)

    def load(self, key: str, args: tuple) -> Any | None:
        """The entry of ``key`` loaded, or None: absent, or unusable (with a warning)."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("executable cache: cannot read %s (%s); compiling instead", path, e)
            return None
        try:
            from jax.experimental import serialize_executable

            entry = pickle.loads(data)
            if not isinstance(entry, dict) or entry.get("format") != FORMAT_VERSION:
                raise ValueError("another format")
            if entry.get("key") != key:
                raise ValueError("written for another key")
            in_tree, out_tree = pickle.loads(entry["trees"])
            executable = serialize_executable.deserialize_and_load(
                entry["executable"], in_tree, out_tree)
            _check_signature(executable, args)
        except Exception as e:  # a damaged or foreign entry: compile, and overwrite it
            log.warning("executable cache: unusable entry %s (%s: %s); compiling instead",
                        path, type(e).__name__, e)
            return None
        return executable

    def store(self, key: str, compiled: Any) -> bool:
        """Write ``compiled`` under ``key`` (best effort); whether it was written."""
        path = self.path(key)
        try:
            from jax.experimental import serialize_executable

            blob, in_tree, out_tree = serialize_executable.serialize(compiled)
            data = pickle.dumps({"format": FORMAT_VERSION, "key": key, "executable": blob,
                                 "trees": pickle.dumps((in_tree, out_tree))})
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
        except Exception as e:
            log.warning("executable cache: cannot write %s (%s: %s)", path,
                        type(e).__name__, e)
            return False
        return True


_thread = threading.local()  # xla_cache_hit: the last compile on this thread was one


@functools.cache
def _listen_for_xla_cache_hits() -> None:
    """Record, per thread, whether a compile was served by XLA's persistent cache."""
    def listener(event: str, **kwargs: Any) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            _thread.xla_cache_hit = True

    jax.monitoring.register_event_listener(listener)


def _check_signature(executable: Any, args: tuple) -> None:
    """Raise unless ``executable`` takes arguments shaped like the non-static ``args``
    (a mismatch would otherwise fail on the engine thread at the first call)."""
    expected = [(tuple(np.shape(a)), np.dtype(a.dtype).name)
                for a in jax.tree.leaves(args) if hasattr(a, "dtype")]
    info = jax.tree.leaves(executable.args_info,
                           is_leaf=lambda x: hasattr(x, "_aval") or hasattr(x, "shape"))
    got = []
    for leaf in info:
        aval: Any = getattr(leaf, "_aval", leaf)
        got.append((tuple(aval.shape), np.dtype(aval.dtype).name))
    if got != expected:
        raise ValueError(f"argument signature differs ({len(got)} arguments cached, "
                         f"{len(expected)} passed)")


def signature(args: tuple) -> str:
    """The tree of ``args`` with each array leaf's shape, dtype, weak type and placement
    (other leaves, static arguments, by ``repr``)."""
    leaves, treedef = jax.tree.flatten(args)
    parts = [str(treedef)]
    for leaf in leaves:
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            sharding = getattr(leaf, "sharding", None)
            parts.append(f"{tuple(leaf.shape)}:{np.dtype(leaf.dtype).name}:"
                         f"{getattr(leaf, 'weak_type', False)}:{_sharding_text(sharding)}")
        else:
            parts.append(repr(leaf))
    return "|".join(parts)


def _sharding_text(sharding: Any) -> str:
    if sharding is None:
        return "-"
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        (device,) = sharding.device_set
        return f"single:{getattr(device, 'platform', '')}:{getattr(device, 'id', '')}"
    return repr(sharding)


@functools.cache
def environment_fingerprint() -> str:
    """What else an executable depends on: JAX, the backend, its devices, the CPU's
    features, XLA_FLAGS, the source of ``SOURCE_PACKAGES`` and the native ops' library
    (registered here, so a loaded executable finds its custom-call targets)."""
    import jaxlib

    devices = jax.devices()
    backend = devices[0].client
    parts = [
        f"jax={jax.__version__}", f"jaxlib={jaxlib.__version__}",
        f"platform={backend.platform}:{backend.platform_version}",
        f"devices={[(d.id, d.device_kind) for d in devices]}",
        f"processes={jax.process_count()}",
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}",
        f"x64={jax.config.values.get('jax_enable_x64')}",
        f"precision={jax.config.values.get('jax_default_matmul_precision')}",
        f"cpu={_cpu_features()}",
        f"source={source_hash(SOURCE_PACKAGES)}",
        f"native={native.fingerprint()}",
    ]
    return "\n".join(parts)


def _cpu_features() -> str:
    """The CPU's model and feature flags (Linux; elsewhere the platform's machine name):
    XLA:CPU compiles for the host's instruction set."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        import platform

        return platform.machine() + ":" + platform.processor()
    wanted = ("model name", "flags")
    found = {}
    for line in lines:
        name, _, value = line.partition(":")
        name = name.strip()
        if name in wanted and name not in found:
            found[name] = value.strip()
    return hashlib.sha256(repr(sorted(found.items())).encode()).hexdigest()


@functools.cache
def source_hash(packages: Iterable[str]) -> str:
    """A hash of every ``.py`` file of ``packages`` (paths and contents)."""
    import importlib.util

    h = hashlib.sha256()
    for package in packages:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            h.update(f"{package}:missing".encode())
            continue
        for root in spec.submodule_search_locations:
            for path in sorted(Path(root).rglob("*.py")):
                h.update(str(path.relative_to(root)).encode())
                h.update(path.read_bytes())
    return h.hexdigest()


def describe(obj: Any, skip: Iterable[str] = ()) -> dict[str, str]:
    """``obj``'s plain attributes (numbers, strings, tuples, dataclasses) as text: what
    its traced methods read besides their arguments."""
    skipped = set(skip)
    out = {}
    for name, value in sorted(vars(obj).items()):
        if name in skipped or not _plain(value):
            continue
        text = repr(value)
        if " at 0x" in text:  # an address: another key in every process, never a hit
            continue
        out[name] = text
    return out


def _plain(value: Any) -> bool:
    import dataclasses

    if value is None or isinstance(value, str | int | float | bool):
        return True
    if isinstance(value, tuple | list | frozenset):
        return all(_plain(v) for v in value)
    return dataclasses.is_dataclass(value) and not isinstance(value, type)
