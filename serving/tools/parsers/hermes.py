"""Hermes-style calls (Qwen2.5, Qwen3, Hermes, the shipped SmolLM2 template):
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call. Content
is the text before the first block (and, in a finished output, any text between blocks
and any block that is not a well-formed call)."""

from __future__ import annotations

from serving.tools.jsonscan import scan_call
from serving.tools.parsers.base import Parsed, ParsedCall, ToolParser, held_back

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    start, end = START, END

    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(self.start)
        if first < 0:
            return Parsed(text if final else text[:len(text) - held_back(text, self.start)])
        calls: list[ParsedCall] = []
        content = [text[:first]]
        pos = first
        while pos >= 0:
            inner = pos + len(self.start)
            close = text.find(self.end, inner)
            body_end = close if close >= 0 else len(text) - held_back(text, self.end)
            block_end = close + len(self.end) if close >= 0 else len(text)
            scan = scan_call(text[:body_end], inner, memo=self.memo)
            if not final:
                if scan.name is None:
                    break
                calls.append(ParsedCall(scan.name, scan.arguments))
            elif scan.complete and not text[scan.end:body_end].strip():  # type: ignore[index]
                calls.append(ParsedCall(scan.name, scan.final_arguments))  # type: ignore[arg-type]
            else:
                content.append(text[pos:block_end])
            if close < 0:
                break
            pos = text.find(self.start, block_end)
            if final:
                content.append(text[block_end:pos if pos >= 0 else len(text)])
        if final and not calls:
            return Parsed(text)
        return Parsed("".join(content), self.limit(calls))
