"""Policies by name: the registry, ``module:Class`` paths, and the scheduler factory.

Wherever a policy is named, it is a registered name (the built-ins ``fcfs``, ``swap``,
``rotasched``, or a plug-in's ``register_policy``) or a path, ``package.module:Class``
(the current directory is added when the module is not found, as uvicorn does).
``resolve_policy`` is the one place a name becomes a class and its errors are worded.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from superinfer_jax.config import EngineConfig
from superinfer_jax.kv.page_allocator import KVCacheManager
from superinfer_jax.sched.latency import LatencyModel
from superinfer_jax.sched.rotasched.policies import FCFSPolicy, RotaSchedPolicy, SwapPolicy
from superinfer_jax.sched.rotasched.policy import POLICY_METHODS
from superinfer_jax.sched.scheduler import Scheduler

if TYPE_CHECKING:
    from superinfer_jax.sched.rotasched.policy import Policy

__all__ = ["import_class_path", "make_policy", "make_scheduler", "policy_problem",
           "register_policy", "registered_policies", "resolve_policy"]

# the built-ins; ``register_policy`` adds plug-ins
_REGISTRY: dict[str, type] = {"fcfs": FCFSPolicy, "swap": SwapPolicy,
                              "rotasched": RotaSchedPolicy}
P = TypeVar("P", bound=type)


def register_policy(name: str) -> Callable[[P], P]:
    """Class decorator: make the policy available as ``name``."""
    def register(cls: P) -> P:
        missing = _missing_methods(cls)
        if missing:
            raise TypeError(f"{cls.__qualname__} does not implement the policy interface "
                            f"(missing {', '.join(missing)})")
        _REGISTRY[name] = cls
        return cls
    return register


def registered_policies() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def resolve_policy(spec: str) -> type[Policy]:
    """The policy class ``spec`` names; a ValueError that says what is missing if none."""
    cls, problem = _resolve(spec)
    if problem is not None:
        raise ValueError(f"policy {problem}")
    return cls  # type: ignore[return-value]


def policy_problem(spec: Any) -> str | None:
    """What is wrong with ``spec`` as a policy name (None: nothing), worded to follow the
    field's name: ``policy must be one of ...``. For configuration validation."""
    return _resolve(spec)[1]


def make_policy(config: EngineConfig) -> Policy:
    return resolve_policy(config.engine.policy)(config)


def make_scheduler(config: EngineConfig, kv: KVCacheManager,
                   latency: LatencyModel | None = None, *, page_bytes: int = 0,
                   shadowing: bool = False) -> Scheduler:
    """The scheduler of ``config.policy``: see ``Scheduler`` for the arguments."""
    return Scheduler(config, kv, make_policy(config), page_bytes=page_bytes, latency=latency,
                     shadowing=shadowing)


def _resolve(spec: Any) -> tuple[type | None, str | None]:
    obj, problem = import_class_path(spec, _REGISTRY, "policy")
    if problem is not None or obj is None:
        return None, problem
    attr = spec.partition(":")[2] or spec
    if not isinstance(obj, type):
        return None, f"{spec!r}: {attr} is not a class (a policy is built as Class(config))"
    missing = _missing_methods(obj)
    if missing:
        return None, (f"{spec!r}: {attr} does not implement the policy interface (missing "
                      f"{', '.join(missing)}); subclass superinfer_jax.sched.rotasched.Policy")
    return obj, None


def import_class_path(spec: Any, registry: dict[str, Any], what: str
                      ) -> tuple[Any | None, str | None]:
    """A plug-in named by ``spec``: (the registered entry or the object a
    ``package.module:Class`` path names, None), or (None, what is wrong, worded to follow
    the key's name: ``must be one of ...``). A module is also looked for in the working
    directory, as ``python -m`` would."""
    if isinstance(spec, str) and spec in registry:
        return registry[spec], None
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        plural = what[:-1] + "ies" if what.endswith("y") else what + "s"
        return None, (f"must be one of the registered {plural} {list(registry)} or a "
                      f"package.module:Class path, got {spec!r}")
    module_name, attr = spec.split(":")
    try:
        module = _import(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure is reported, named
        return None, f"{spec!r}: cannot import module {module_name!r} ({type(e).__name__}: {e})"
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None, f"{spec!r}: module {module_name!r} has no attribute {attr!r}"
    return obj, None


def _missing_methods(cls: type) -> list[str]:
    return [m for m in POLICY_METHODS if not callable(getattr(cls, m, None))]


def _import(module_name: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        here = os.getcwd()
        top = module_name.split(".")[0]
        if e.name != top or here in sys.path or "" in sys.path:
            raise
        sys.path.append(here)
        return importlib.import_module(module_name)
