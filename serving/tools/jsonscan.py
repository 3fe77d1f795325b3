"""Scanning tool-call JSON as it is generated: where a value ends, and a call object's
``name`` and raw ``arguments`` text, on text that may stop anywhere.

Every function reads a prefix of the final output and never claims more than that prefix
proves: a name is reported once its string is closed, the arguments as the raw text so far
(a prefix of their final text), so a stream can send the difference at each step.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_WS = " \t\r\n"
_SCALAR_END = ",}]; \t\r\n"


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


# a closed JSON string (the unrolled loop: C-speed), else a bracket, else a lone quote
# (a string still open)
_STRING = r'"[^"\\]*(?:\\.[^"\\]*)*"'
_CLOSED_STRING = re.compile(_STRING, re.DOTALL)
_TOKENS = re.compile(_STRING + r'|[\[\]{}]|"', re.DOTALL)


def string_end(text: str, i: int) -> int | None:
    """Index after the JSON string opening at ``text[i]`` (a quote); None if unclosed."""
    m = _CLOSED_STRING.match(text, i)
    return m.end() if m else None


# value_end's progress on containers still open, by start index: (position to resume
# at, depth there, the 16 characters before it, which must still be there)
Memo = dict[int, tuple[int, int, str]]


def value_end(text: str, i: int, memo: Memo | None = None) -> int | None:
    """Index after the JSON value starting at ``text[i]``; None while it may go on.
    ``memo``: a stream's progress, so text that only grows is read once, not once per
    delta."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return string_end(text, i)
    if c in "{[":
        pos, depth = i, 0
        seen = memo.get(i) if memo is not None else None
        if seen is not None and seen[0] <= len(text) and \
                text[max(i, seen[0] - 16):seen[0]] == seen[2]:
            pos, depth = seen[0], seen[1]
        for m in _TOKENS.finditer(text, pos):
            token = m.group()
            if token == '"':
                pos = m.start()
                break
            if token[0] == '"':
                continue
            depth += 1 if token in "{[" else -1
            if depth == 0:
                return m.end()
        else:
            pos = len(text)
        if memo is not None:
            memo[i] = (pos, depth, text[max(i, pos - 16):pos])
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


def scan_call(text: str, i: int, args_keys: tuple[str, ...] = ("arguments", "parameters"),
              memo: Memo | None = None) -> CallScan:
    """The call object (``{"name": ..., "arguments": {...}}``) starting at ``text[i]``
    (after whitespace); ``memo`` as ``value_end``'s."""
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
        end = value_end(text, i, memo)
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
               args_keys: tuple[str, ...] = ("arguments", "parameters"),
               memo: Memo | None = None) -> tuple[list[CallScan], bool]:
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
        call = scan_call(text, i, args_keys, memo)
        if call.broken:
            return calls, True
        calls.append(call)
        if call.end is None:
            return calls, False
        i = call.end
