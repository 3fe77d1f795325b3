"""One validator for every configuration dataclass: field metadata is the schema.

A configuration field is declared with ``knob(default, help=..., ge=..., choices=...)``.
The metadata it carries is read by three users, so each fact is written once:

- ``validate(obj)``, called by the dataclass's ``__post_init__`` (``EngineConfig``,
  ``RotaSchedConfig``, the server's own sections): types from the annotations (a bool is
  not an int, a float must be finite), then choices, bounds and an optional ``check``;
- the deployment file's schema (``serving.config_schema``): each field's default and help
  text (its section and key are the dataclass's and the field's names);
- the generated ``superinfer_config.yaml`` and the command-line flags' help.

Every failure is a ``ConfigError(key, message)``: ``key`` names the field as its reader
spelled it (``max_num_seqs``, ``rotasched.alpha``, or the YAML key once the deployment
layer has mapped it), ``message`` says what is wrong (``must be >= 0, got -1``).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any


class ConfigError(ValueError):
    """A configuration value that cannot be used; ``key`` names it.

    ``str(e)`` reads as a sentence, ``"rotasched.alpha must be >= 0, got -1"``; the CLI
    prints ``error: <key>: <message>``."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key} {message}")
        self.key = key
        self.message = message

    def with_key(self, key: str) -> ConfigError:
        """The same error, naming the field by another spelling (its YAML key)."""
        return ConfigError(key, self.message)


# A field-level check beyond type, choices and bounds: returns None when the value is
# fine, else the message (``"must be a power of two, got 12"``); or raises ConfigError
# itself to name a part of the value (``rotasched.priority_weights.critical``).
Check = Callable[[str, Any], str | None]


def knob(default: Any = dataclasses.MISSING, *, help: str,
         default_factory: Any = dataclasses.MISSING, ge: float | None = None,
         gt: float | None = None, le: float | None = None,
         choices: tuple[Any, ...] | None = None, check: Check | None = None,
         example: Any = None) -> Any:
    """A configuration field: its default, help text and what values it accepts.

    ``example``: a value shown, commented out, in the generated file for a key whose
    default is null."""
    meta = {"help": help, "ge": ge, "gt": gt, "le": le, "choices": choices, "check": check,
            "example": example}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def internal(default: Any, *, reason: str) -> Any:
    """A field that is not a deployment knob (set by the program, not a config file)."""
    return dataclasses.field(default=default, metadata={"internal": reason})


_HINTS: dict[type, dict[str, Any]] = {}


def type_hints(cls: type) -> dict[str, Any]:
    """Resolved annotations of a dataclass (cached: ``__post_init__`` runs often)."""
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


def validate(obj: Any, prefix: str = "") -> None:
    """Check every field of the dataclass instance ``obj``; errors name
    ``prefix + field``."""
    hints = type_hints(type(obj))
    for f in dataclasses.fields(obj):
        check_value(prefix + f.name, getattr(obj, f.name), hints[f.name], f.metadata)


def check_value(key: str, value: Any, hint: Any, meta: Mapping[str, Any]) -> None:
    """The one validator: ``value`` against the annotation ``hint`` and the field
    metadata ``meta`` (choices, ge, gt, le, check). Raises ``ConfigError(key, ...)``."""
    allowed = typing.get_args(hint) if _is_union(hint) else (hint,)
    if value is None:
        if type(None) not in allowed:
            raise ConfigError(key, "must not be null")
        return
    base = next(t for t in allowed if t is not type(None))
    if not _type_ok(value, base):
        raise ConfigError(key, f"must be {type_word(base)}, got {value!r}")
    if typing.get_origin(base) is dict:
        value_type = typing.get_args(base)[1]
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(key, f"keys must be strings, got {k!r}")
            if not _type_ok(v, value_type):
                raise ConfigError(f"{key}.{k}", f"must be {type_word(value_type)}, got {v!r}")
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(key, f"must be one of {list(choices)}, got {value!r}")
    for bound, ok, word in (("ge", _ge, ">="), ("gt", _gt, ">"), ("le", _le, "<=")):
        b = meta.get(bound)
        if b is not None and not ok(value, b):
            raise ConfigError(key, f"must be {word} {b}, got {value!r}")
    check = meta.get("check")
    if check is not None:
        message = check(key, value)
        if message is not None:
            raise ConfigError(key, message)


def _ge(v: Any, b: Any) -> bool:
    return bool(v >= b)


def _gt(v: Any, b: Any) -> bool:
    return bool(v > b)


def _le(v: Any, b: Any) -> bool:
    return bool(v <= b)


def _is_union(hint: Any) -> bool:
    return isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union


def _type_ok(value: Any, base: Any) -> bool:
    if base is bool:
        return isinstance(value, bool)
    if base is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if base is float:
        return (isinstance(value, int | float) and not isinstance(value, bool)
                and math.isfinite(value))
    origin = typing.get_origin(base)
    if origin is not None:
        return isinstance(value, origin)
    return isinstance(value, base)


def type_word(t: Any) -> str:
    """How a type reads in an error message and in help text."""
    words = {bool: "true or false", int: "an integer", float: "a finite number",
             str: "a string"}
    if t in words:
        return words[t]
    if typing.get_origin(t) is dict:
        value_type = typing.get_args(t)[1]
        return "a mapping of names to " + ("numbers" if value_type is float
                                           else f"{type_word(value_type)} values")
    return f"an instance of {getattr(t, '__name__', t)}"


def power_of_two(key: str, value: Any) -> str | None:
    """A ``check``: the value must be a power of two."""
    return None if value & (value - 1) == 0 else f"must be a power of two, got {value}"
