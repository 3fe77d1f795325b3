"""The tool-call parser interface: model output text in, content and calls out.

A parser only implements ``parse(text, final)``. With ``final`` false the text is what the
model has written so far, and the result must be *prefix-stable*: its content, and each
call's name and arguments, are prefixes of what any longer text parses to, so a stream
sends only the difference (``serving.tools.output``). Text that may still turn into a call
(a partial ``<tool_call>`` tag) is held back. With ``final`` true the result is the
non-streamed message: complete calls only, the rest of the text as content.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from serving.tools.jsonscan import CallScan, Memo


@dataclass(frozen=True)
class ParsedCall:
    """A call as far as it is known: ``name`` None until its string is closed,
    ``arguments`` the raw JSON text so far."""

    name: str | None
    arguments: str


@dataclass(frozen=True)
class Parsed:
    content: str
    calls: tuple[ParsedCall, ...] = ()


class ToolParser(ABC):
    """Parses one model's tool-call syntax. Built per request with the request's tool
    definitions (OpenAI's ``{"type": "function", "function": {...}}`` dicts) and whether
    several calls may be returned (``parallel``: False keeps the first)."""

    def __init__(self, tools: Sequence[dict[str, Any]] = (), parallel: bool = True):
        self.tools = tuple(tools)
        self.parallel = parallel
        # the scanners' progress over this request's growing text (``jsonscan.Memo``)
        self.memo: Memo = {}

    @abstractmethod
    def parse(self, text: str, final: bool) -> Parsed:
        """Content and calls of ``text`` (see the module docstring for ``final``)."""

    def limit(self, calls: Sequence[ParsedCall]) -> tuple[ParsedCall, ...]:
        return tuple(calls if self.parallel else calls[:1])


def held_back(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of ``tag``: text that
    may yet become the tag, so a stream waits before sending it as content."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def streaming_calls(scans: Sequence[CallScan]) -> list[ParsedCall]:
    """Calls to show while streaming: every scanned call, in order, up to the first
    without a name yet."""
    out = []
    for s in scans:
        if s.name is None:
            break
        out.append(ParsedCall(s.name, s.arguments))
    return out


def final_calls(scans: Sequence[CallScan]) -> list[ParsedCall] | None:
    """The calls of a finished output, or None if any is incomplete or malformed."""
    if not scans or not all(s.complete for s in scans):
        return None
    return [ParsedCall(s.name, s.final_arguments) for s in scans]  # type: ignore[misc]
