"""Llama 3.1/3.2 JSON calls: the whole output is ``{"name": ..., "parameters": {...}}``
(``arguments`` also read), optionally after ``<|python_tag|>``, several separated by
``;``. Output that does not start with ``{`` is content; a finished output that starts
with ``{`` but is not all well-formed calls is content too."""

from __future__ import annotations

from serving.tools.jsonscan import scan_calls
from serving.tools.parsers.base import (
    Parsed,
    ToolParser,
    final_calls,
    held_back,
    streaming_calls,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> Parsed:
        body = text.lstrip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):]
        elif not body or (not final and held_back(body, PYTHON_TAG) == len(body)):
            return Parsed(text if final else "")
        if not body.lstrip().startswith("{"):
            return Parsed(text if final or body.strip() else "")
        scans, broken = scan_calls(body, 0, array=False, memo=self.memo)
        if final:
            calls = None if broken else final_calls(scans)
            return Parsed(text) if calls is None else Parsed("", self.limit(calls))
        return Parsed("", self.limit(streaming_calls(scans)))
