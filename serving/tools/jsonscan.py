"""Scanning tool-call JSON as it is generated: where a value ends, and a call object's
``name`` and raw ``arguments`` text, on text that may stop anywhere.

Every function reads a prefix of the final output and never claims more than that prefix
proves: a name is reported once its string is closed, the arguments as the raw text so far
(a prefix of their final text), so a stream can send the difference at each step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_WS = " \t\r\n"
_SCALAR_END = ",}]; \t\r\n"


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """Index after the JSON string opening at ``text[i]`` (a quote); None if unclosed."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """Index after the JSON value starting at ``text[i]``; None while it may go on."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return string_end(text, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                end = string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in _SCALAR_END:
        j += 1
    return j if j < len(text) else None


@dataclass(frozen=True)
class CallScan:
    """One call object as far as the text goes. ``arguments``: the raw text of the
    arguments value so far; ``args_done``: it is complete; ``end``: the index after the
    object's closing brace (None: not closed yet); ``broken``: not a call object."""

    name: str | None = None
    arguments: str = ""
    args_done: bool = False
    end: int | None = None
    broken: bool = False

    @property
    def complete(self) -> bool:
        """Closed, named, and its arguments a JSON object (absent arguments count as
        ``{}``, as parsers of every format read them)."""
        if self.broken or self.end is None or self.name is None:
            return False
        if not self.args_done:
            return True
        try:
            return isinstance(json.loads(self.arguments), dict)
        except ValueError:
            return False

    @property
    def final_arguments(self) -> str:
        return self.arguments if self.args_done else "{}"


_BROKEN = CallScan(broken=True)


def scan_call(text: str, i: int, args_keys: tuple[str, ...] = ("arguments", "parameters")
              ) -> CallScan:
    """The call object (``{"name": ..., "arguments": {...}}``) starting at ``text[i]``
    (after whitespace)."""
    i = skip_ws(text, i)
    if i >= len(text):
        return CallScan()
    if text[i] != "{":
        return _BROKEN
    i += 1
    name: str | None = None
    args, args_done = "", False
    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            return CallScan(name, args, args_done)
        if text[i] == "}":
            return CallScan(name, args, args_done, i + 1)
        if text[i] == ",":
            i += 1
            continue
        if text[i] != '"':
            return _BROKEN
        key_end = string_end(text, i)
        if key_end is None:
            return CallScan(name, args, args_done)
        key = _string(text[i:key_end])
        if key is None:
            return _BROKEN
        i = skip_ws(text, key_end)
        if i >= len(text):
            return CallScan(name, args, args_done)
        if text[i] != ":":
            return _BROKEN
        i = skip_ws(text, i + 1)
        end = value_end(text, i)
        if key in args_keys and not args_done:
            if end is None:
                return CallScan(name, text[i:], False)
            args, args_done = text[i:end], True
        elif end is None:
            return CallScan(name, args, args_done)
        elif key == "name":
            value = _string(text[i:end]) if text[i] == '"' else None
            if value is None:
                return _BROKEN
            name = value
        i = end


def _string(token: str) -> str | None:
    try:
        value = json.loads(token)
    except ValueError:  # a bad escape
        return None
    return value if isinstance(value, str) else None


def scan_calls(text: str, i: int, *, array: bool,
               args_keys: tuple[str, ...] = ("arguments", "parameters")
               ) -> tuple[list[CallScan], bool]:
    """Call objects one after another from ``text[i]``: a JSON array of them (``array``)
    or a run separated by ``,``/``;``/whitespace. Returns the calls so far and whether
    the text stopped being one."""
    i = skip_ws(text, i)
    if array:
        if i >= len(text):
            return [], False
        if text[i] != "[":
            return [], True
        i += 1
    calls: list[CallScan] = []
    while True:
        i = skip_ws(text, i)
        if i >= len(text) or (array and text[i] == "]"):
            return calls, False
        if text[i] in ",;":
            i += 1
            continue
        call = scan_call(text, i, args_keys)
        if call.broken:
            return calls, True
        calls.append(call)
        if call.end is None:
            return calls, False
        i = call.end
