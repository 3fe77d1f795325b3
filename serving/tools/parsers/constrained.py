"""The output of a constrained call (``tool_choice`` named or ``required``): JSON the
grammar forced, so no tags to look for.

- named: the whole output is the function's arguments;
- required: ``{"name": ..., "arguments": {...}}``, or with ``parallel_tool_calls`` a JSON
  array of them (``serving.tools.constraint`` writes the schema, name first).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from serving.tools.jsonscan import scan_calls
from serving.tools.parsers.base import (
    Parsed,
    ParsedCall,
    ToolParser,
    final_calls,
    streaming_calls,
)


class NamedCallParser(ToolParser):
    def __init__(self, name: str, tools: Sequence[dict[str, Any]] = ()):
        super().__init__(tools, parallel=False)
        self.name = name

    def parse(self, text: str, final: bool) -> Parsed:
        return Parsed("", (ParsedCall(self.name, text.strip() if final else text.lstrip()),))


class RequiredCallParser(ToolParser):
    def parse(self, text: str, final: bool) -> Parsed:
        scans, broken = scan_calls(text, 0, array=self.parallel, args_keys=("arguments",),
                                   memo=self.memo)
        if not self.parallel:
            scans = scans[:1]
        if final:
            calls = None if broken else final_calls(scans)
            if calls is None:  # cut short (max_tokens): what was written, as arguments
                calls = [ParsedCall(s.name, s.arguments) for s in scans if s.name]
            return Parsed("", tuple(calls))
        return Parsed("", tuple(streaming_calls(scans)))
