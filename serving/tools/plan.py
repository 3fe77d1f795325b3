"""One request's tool handling, decided before it is submitted: what the chat template
gets as ``tools``, the constraint a forced call is generated under, and the parser its
output goes through. Every front (HTTP chat, the Responses API, gRPC, batch) calls
``plan_output`` and reads its answer the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from serving.tools.constraint import constraint_schema
from serving.tools.output import OutputParser
from serving.tools.parsers.base import ToolParser
from serving.tools.parsers.constrained import NamedCallParser, RequiredCallParser
from serving.tools.parsers.registry import resolve_tool_parser
from serving.tools.reasoning import resolve_reasoning_parser
from serving.tools.spec import ToolRequest, parse_tool_request
from serving.tools.template import renders_parallel_calls, renders_tools
from superinfer_jax.request import FieldError


@dataclass(frozen=True)
class OutputPlan:
    """``template_tools``: the ``tools`` argument of the chat template (None: none);
    ``constraint``: the JSON schema the output is held to (None: free text);
    ``parser``: reads the finished or streamed text."""

    request: ToolRequest | None
    template_tools: list[dict[str, Any]] | None
    constraint: dict[str, Any] | None
    parser: OutputParser


def plan_output(tools: Sequence[Any] | None, tool_choice: Any, parallel_tool_calls: Any,
                *, tokenizer: Any, tool_call_parser: str | None = None,
                reasoning_parser: str | None = None) -> OutputPlan:
    """The plan of one chat request; a ``FieldError`` naming the field (``tools[i]...``,
    ``tool_choice``, ``parallel_tool_calls``) when it cannot be honoured."""
    req = parse_tool_request(tools, tool_choice, parallel_tool_calls)
    reasoning = resolve_reasoning_parser(reasoning_parser)() if reasoning_parser else None
    if req is None:
        return OutputPlan(None, None, None, OutputParser(None, reasoning))
    with_tools = renders_tools(tokenizer)
    if req.mode == "auto":
        if tool_call_parser is None:
            raise FieldError("tool_choice", 'tool_choice "auto" (the default with tools) '
                             "needs a tool-call parser and this server has none "
                             "(server.tool_call_parser); send tool_choice \"required\" or "
                             "a named function, which are generated under the schema")
        if not with_tools:
            raise FieldError("tool_choice", 'tool_choice "auto": this model\'s chat '
                             "template does not show the model its tools; serve it with a "
                             "tool-aware template (--chat-template), or send \"required\" "
                             "or a named function")
    if req.parallel and req.mode != "named" and not renders_parallel_calls(tokenizer):
        raise FieldError("parallel_tool_calls", "parallel_tool_calls: this model's chat "
                         "template cannot render several tool calls in one turn; send "
                         "false")
    factory = _tool_parser(req, tool_call_parser)
    template_tools = req.openai_tools() if with_tools else None
    return OutputPlan(req, template_tools, constraint_schema(req),
                      OutputParser(factory, reasoning))


def _tool_parser(req: ToolRequest, name: str | None) -> Callable[[], ToolParser]:
    tools = req.openai_tools()
    if req.mode == "named":
        forced = req.name
        assert forced is not None
        return lambda: NamedCallParser(forced, tools)
    if req.mode == "required":
        return lambda: RequiredCallParser(tools, parallel=bool(req.parallel))
    assert name is not None
    cls = resolve_tool_parser(name)
    return lambda: cls(tools, parallel=req.parallel is not False)
