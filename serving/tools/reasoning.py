"""Reasoning parsers: a thinking model's ``<think>...</think>`` moved out of the answer
into ``reasoning_content``, before tool calls are parsed (``server.reasoning_parser``, as
vLLM's ``--reasoning-parser``).

- ``qwen3``: reasoning only when the output opens with ``<think>``; it runs to
  ``</think>`` (to the end of a cut-short output). Output without the tag is all content.
- ``deepseek_r1``: the template opens the thought in the prompt, so the output is
  reasoning from its first token (a leading ``<think>`` is dropped) until ``</think>``;
  an output that never closes it is all reasoning.

Like tool parsers, ``parse(text, final)`` is prefix-stable while not final (a partial tag
is held back). Plug-ins subclass ``ReasoningParser`` and are named ``module:Class``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from serving.tools.parsers.base import held_back
from serving.tools.parsers.registry import require_plugin, resolve_plugin


class ReasoningParser(ABC):
    @abstractmethod
    def parse(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of ``text``."""


class ThinkTagParser(ReasoningParser):
    start, end = "<think>", "</think>"
    implicit_start = False  # reasoning from the first token without a start tag

    def parse(self, text: str, final: bool) -> tuple[str, str]:
        body = text.lstrip()
        if body.startswith(self.start):
            body = body[len(self.start):]
        elif not final and body and held_back(body, self.start) == len(body):
            return "", ""  # may yet be the start tag
        elif not self.implicit_start:
            return "", text if final or body else ""
        close = body.find(self.end)
        if close >= 0:
            return body[:close], body[close + len(self.end):].lstrip()
        return (body if final else body[:len(body) - held_back(body, self.end)]), ""


class Qwen3ReasoningParser(ThinkTagParser):
    pass


class DeepSeekR1ReasoningParser(ThinkTagParser):
    implicit_start = True


_REGISTRY: dict[str, type] = {"qwen3": Qwen3ReasoningParser,
                              "deepseek_r1": DeepSeekR1ReasoningParser}


def reasoning_parser_problem(spec: Any) -> str | None:
    return resolve_plugin(spec, _REGISTRY, ReasoningParser, "reasoning parser")[1]


def resolve_reasoning_parser(spec: str) -> type[ReasoningParser]:
    return require_plugin(spec, _REGISTRY, ReasoningParser, "reasoning parser",
                          "reasoning_parser")
