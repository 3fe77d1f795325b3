"""A chat choice's text as the client gets it: reasoning split off first
(``serving.tools.reasoning``), then tool calls (a tool parser, or the reader of a forced
call), the rest content. ``OutputParser.final`` gives the non-streamed message,
``OutputParser.stream`` a ``MessageStream`` that turns text deltas into OpenAI's chat
deltas (``reasoning_content``, ``content``, ``tool_calls[i]``: id and name first, then
argument fragments)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from serving.tools.parsers.base import Parsed, ToolParser
from serving.tools.reasoning import ReasoningParser


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedMessage:
    """The assistant message of a finished choice. ``content`` is None when it is empty
    beside tool calls (OpenAI's null content of a call)."""

    content: str | None
    reasoning_content: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()

    def message_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [c.openai() for c in self.tool_calls]
        return out


def finish_reason(engine_reason: str, has_calls: bool) -> str:
    """OpenAI's finish reason: ``tool_calls`` for a choice that ended by itself with
    calls; a cut-short one stays ``length``."""
    if has_calls and engine_reason == "stop":
        return "tool_calls"
    return {"stop": "stop", "length": "length", "abort": "length"}.get(engine_reason, "stop")


class OutputParser:
    """Reads one request's choices; stateless (each ``stream()`` has its own state).
    ``tools``: a factory of the request's tool parser (None: no tool calls to read)."""

    def __init__(self, tools: Callable[[], ToolParser] | None = None,
                 reasoning: ReasoningParser | None = None):
        self.tools = tools
        self.reasoning = reasoning

    @property
    def plain(self) -> bool:
        """The text is the content as it comes: nothing to parse."""
        return self.tools is None and self.reasoning is None

    def split(self, text: str, final: bool, parser: ToolParser | None
              ) -> tuple[str | None, Parsed]:
        reasoning: str | None = None
        if self.reasoning is not None:
            reasoning, text = self.reasoning.parse(text, final)
        parsed = parser.parse(text, final) if parser is not None else Parsed(text)
        return reasoning, parsed

    def final(self, text: str) -> ParsedMessage:
        parser = self.tools() if self.tools is not None else None
        reasoning, parsed = self.split(text, True, parser)
        calls = tuple(ToolCall(new_call_id(), c.name, c.arguments)
                      for c in parsed.calls if c.name is not None)
        content: str | None = parsed.content
        if calls and not (content or "").strip():
            content = None
        return ParsedMessage(content, reasoning or None, calls)

    def stream(self) -> MessageStream:
        return MessageStream(self)


class MessageStream:
    """One streamed choice: ``feed`` each text delta, ``finish`` at the end; each returns
    the chat deltas to send (dicts for ``choices[i].delta``)."""

    def __init__(self, parser: OutputParser):
        self.parser = parser
        self._tools = parser.tools() if parser.tools is not None else None
        self.text = ""
        self._reasoning = ""
        self._content = ""
        self._calls: list[tuple[str, str]] = []  # (name, arguments sent)

    @property
    def has_calls(self) -> bool:
        return bool(self._calls)

    def feed(self, delta: str) -> list[dict[str, Any]]:
        self.text += delta
        return self._diff(False)

    def finish(self) -> list[dict[str, Any]]:
        return self._diff(True)

    def _diff(self, final: bool) -> list[dict[str, Any]]:
        reasoning, parsed = self.parser.split(self.text, final, self._tools)
        out: list[dict[str, Any]] = []
        if reasoning and reasoning.startswith(self._reasoning) and reasoning != self._reasoning:
            out.append({"reasoning_content": reasoning[len(self._reasoning):]})
            self._reasoning = reasoning
        content = parsed.content
        if content.startswith(self._content) and content != self._content and not (
                final and self._calls and not content.strip()):
            out.append({"content": content[len(self._content):]})
            self._content = content
        for i, call in enumerate(parsed.calls):
            if call.name is None:
                break
            if i == len(self._calls):
                self._calls.append((call.name, ""))
                out.append({"tool_calls": [{"index": i, "id": new_call_id(),
                                            "type": "function",
                                            "function": {"name": call.name, "arguments": ""}}]})
            name, sent = self._calls[i]
            if name != call.name or not call.arguments.startswith(sent):
                continue
            if call.arguments != sent:
                out.append({"tool_calls": [{"index": i, "function": {
                    "arguments": call.arguments[len(sent):]}}]})
                self._calls[i] = (name, call.arguments)
        return out
