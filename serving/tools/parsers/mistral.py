"""Mistral calls: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}``
objects. The tag is a special token that a decoder may drop, so an output that starts
with ``[`` is read as the array too. Content is the text before the calls."""

from __future__ import annotations

from serving.tools.jsonscan import scan_calls
from serving.tools.parsers.base import (
    Parsed,
    ToolParser,
    final_calls,
    held_back,
    streaming_calls,
)

TAG = "[TOOL_CALLS]"


class MistralToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> Parsed:
        at = text.find(TAG)
        if at >= 0:
            content, body = text[:at], text[at + len(TAG):]
        elif text.lstrip().startswith("[") and not TAG.startswith(text.lstrip()):
            content, body = "", text
        elif final:
            return Parsed(text)
        else:
            keep = held_back(text, TAG) if text.strip() else len(text)
            return Parsed(text[:len(text) - keep])
        scans, broken = scan_calls(body, 0, array=True, memo=self.memo)
        if final:
            calls = None if broken else final_calls(scans)
            return Parsed(text) if calls is None else Parsed(content, self.limit(calls))
        return Parsed(content, self.limit(streaming_calls(scans)))
