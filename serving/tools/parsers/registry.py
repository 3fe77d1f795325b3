"""Tool-call parsers by name: the built-ins and ``package.module:Class`` plug-ins, as
scheduling policies are named (``superinfer_jax.sched.rotasched.registry``).

A plug-in subclasses ``serving.tools.ToolParser`` (implements ``parse(text, final)``);
``register_tool_parser`` adds one under a short name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from serving.tools.parsers.base import ToolParser
from serving.tools.parsers.hermes import HermesToolParser
from serving.tools.parsers.llama3_json import Llama3JsonToolParser
from serving.tools.parsers.mistral import MistralToolParser
from superinfer_jax.sched.rotasched.registry import import_class_path

_REGISTRY: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser}
T = TypeVar("T", bound=type)


def register_tool_parser(name: str) -> Callable[[T], T]:
    """Class decorator: make the parser available as ``name``."""
    def register(cls: T) -> T:
        if not (isinstance(cls, type) and issubclass(cls, ToolParser)):
            raise TypeError(f"{cls!r} is not a serving.tools.ToolParser subclass")
        _REGISTRY[name] = cls
        return cls
    return register


def registered_tool_parsers() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def resolve_plugin(spec: Any, registry: dict[str, type], base: type,
                   what: str) -> tuple[type | None, str | None]:
    """(the class ``spec`` names, None) or (None, what is wrong), worded to follow the
    key's name: ``must be one of ...``."""
    obj, problem = import_class_path(spec, registry, what)
    if problem is not None:
        return None, problem
    if not (isinstance(obj, type) and issubclass(obj, base)):
        attr = spec.partition(":")[2] or spec
        return None, f"{spec!r}: {attr} is not a {base.__module__}.{base.__name__} subclass"
    return obj, None


def require_plugin(spec: Any, registry: dict[str, type], base: type, what: str,
                   key: str) -> type:
    """``resolve_plugin``'s class, or a ValueError naming ``key`` and what is wrong."""
    cls, problem = resolve_plugin(spec, registry, base, what)
    if problem is not None or cls is None:
        raise ValueError(f"{key} {problem}")
    return cls


def tool_parser_problem(spec: Any) -> str | None:
    """What is wrong with ``spec`` as a tool-call parser (None: nothing)."""
    return resolve_plugin(spec, _REGISTRY, ToolParser, "tool-call parser")[1]


def resolve_tool_parser(spec: str) -> type[ToolParser]:
    return require_plugin(spec, _REGISTRY, ToolParser, "tool-call parser", "tool_call_parser")


