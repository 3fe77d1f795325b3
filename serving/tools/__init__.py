"""Tool calling and reasoning output for every front (HTTP chat, the Responses API, gRPC,
batch): requests checked into a ``ToolRequest`` (``spec``), the schema a forced call is
generated under (``constraint``), the chat template's abilities (``template``), parsers of
models' tool-call syntax (``parsers``, plug-ins by ``module:Class``), reasoning parsers
(``reasoning``), and a finished or streamed text turned into a message (``output``).
``plan_output`` is the one entry point a front needs."""

from serving.tools.output import (
    MessageStream,
    OutputParser,
    ParsedMessage,
    ToolCall,
    finish_reason,
    new_call_id,
)
from serving.tools.parsers import (
    Parsed,
    ParsedCall,
    ToolParser,
    register_tool_parser,
    registered_tool_parsers,
    resolve_tool_parser,
    tool_parser_problem,
)
from serving.tools.plan import OutputPlan, plan_output
from serving.tools.reasoning import (
    ReasoningParser,
    reasoning_parser_problem,
    resolve_reasoning_parser,
)
from serving.tools.spec import ToolRequest, ToolSpec, parse_tool_request
from serving.tools.template import install_chat_template

__all__ = [
    "MessageStream", "OutputParser", "OutputPlan", "Parsed", "ParsedCall", "ParsedMessage",
    "ReasoningParser", "ToolCall", "ToolParser", "ToolRequest", "ToolSpec", "finish_reason",
    "install_chat_template", "new_call_id", "parse_tool_request", "plan_output",
    "reasoning_parser_problem", "register_tool_parser", "registered_tool_parsers",
    "resolve_reasoning_parser", "resolve_tool_parser", "tool_parser_problem",
]
