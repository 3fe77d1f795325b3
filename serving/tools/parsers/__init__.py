"""Tool-call parsers: the interface (``base``), the built-ins (hermes, llama3_json,
mistral), the constrained-call readers and the registry."""

from serving.tools.parsers.base import Parsed, ParsedCall, ToolParser
from serving.tools.parsers.registry import (
    register_tool_parser,
    registered_tool_parsers,
    resolve_tool_parser,
    tool_parser_problem,
)

__all__ = ["Parsed", "ParsedCall", "ToolParser", "register_tool_parser",
           "registered_tool_parsers", "resolve_tool_parser", "tool_parser_problem"]
