"""The gRPC front's chat messages and tool calling: ``ChatMessage``s as template dicts,
``tools``/``tool_choice``/``parallel_tool_calls`` planned by ``serving.tools`` (as the
HTTP chat front does), and a finished output read into the ``Completion``'s
``tool_calls``, ``content`` and ``reasoning_content``."""

from __future__ import annotations

import json
import re
from typing import Any

from serving.tools import OutputPlan, plan_output
from superinfer_jax.request import FieldError

_HTTP_TOOL_FIELD = re.compile(r"^tools\[(\d+)\]\.function\.")


def messages_of(req: Any) -> list[dict[str, Any]]:
    out = []
    for m in req.messages.messages:
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for c in m.tool_calls]
            message["content"] = m.content or None
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        if m.name:
            message["name"] = m.name
        out.append(message)
    return out


def plan_of(req: Any, runtime: Any) -> OutputPlan | None:
    """The request's output plan (messages prompts; None for text and token ids)."""
    uses_tools = bool(req.tools) or req.HasField("tool_choice") or \
        req.HasField("parallel_tool_calls")
    if req.WhichOneof("prompt") != "messages":
        if uses_tools:
            raise FieldError("tools", "tools: tool calling needs a messages prompt")
        return None
    tools = [_tool(i, t) for i, t in enumerate(req.tools)] if req.tools else None
    choice: Any = None
    if req.HasField("tool_choice"):
        kind = req.tool_choice.WhichOneof("kind")
        choice = req.tool_choice.mode if kind == "mode" else {
            "type": "function", "function": {"name": req.tool_choice.function}}
    parallel = req.parallel_tool_calls if req.HasField("parallel_tool_calls") else None
    cfg = runtime.config.server
    plan = plan_output(tools, choice, parallel, tokenizer=runtime.tokenizer,
                       tool_call_parser=cfg.tool_call_parser,
                       reasoning_parser=cfg.reasoning_parser)
    if plan.constraint is not None and req.HasField("structured"):
        raise FieldError("tool_choice", "tool_choice: a forced tool call is generated under "
                         "its function's schema; leave structured unset")
    return plan


def _tool(i: int, tool: Any) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    if tool.parameters:
        try:
            function["parameters"] = json.loads(tool.parameters)
        except ValueError as e:
            raise FieldError(f"tools[{i}].parameters",
                             f"tools[{i}].parameters: not valid JSON: {e}") from e
    return {"type": "function", "function": function}


def proto_field(text: str) -> str:
    """An error of ``serving.tools`` in this proto's spelling (``tools[0].parameters``)."""
    return _HTTP_TOOL_FIELD.sub(r"tools[\1].", text)


def fill_completion(completion: Any, plan: OutputPlan | None, text: str, pb2: Any) -> None:
    """The parsed message into ``completion`` (a ``Completion``), when there is one."""
    if plan is None or plan.parser.plain:
        return
    message = plan.parser.final(text)
    for call in message.tool_calls:
        completion.tool_calls.add(id=call.id, function=pb2.FunctionCall(
            name=call.name, arguments=call.arguments))
    if message.content is not None:
        completion.content = message.content
    if message.reasoning_content is not None:
        completion.reasoning_content = message.reasoning_content
    if message.tool_calls and completion.finish_reason == pb2.FINISH_REASON_STOP:
        completion.finish_reason = pb2.FINISH_REASON_TOOL_CALLS
