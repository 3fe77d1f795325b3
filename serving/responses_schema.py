"""OpenAI's Responses API request (``POST /v1/responses``) and its translation into the
chat-completions request the chat route serves.

The Responses route is a translation layer: ``to_chat`` turns a Responses body into the
chat body (messages, sampling, ``response_format``, ``tools``/``tool_choice``), so
whatever the chat route does (structured outputs, tool calls, reasoning) a Responses
request gets too. ``chat_param`` maps a chat field named by an error back to the field
the client sent.

The server keeps no state (``store: false`` behaviour, whatever ``store`` says):
``previous_response_id`` and ``conversation``, which would need stored responses, are
refused with a 400 naming them, as is ``background``. Only function tools exist here;
other tool types are refused by the schema.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import ConfigDict, Field

from serving.openai_schema import JsonInt, SLOConstraints, _bounded, _Strict
from superinfer_jax.request import FieldError


class InputText(_Strict):
    """A text part of an input message (``input_text``; ``output_text`` when an
    assistant turn is replayed, as the OpenAI Agents SDK does)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None


class MessageItem(_Strict):
    """A message of the conversation. ``developer`` is a system message."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(_Strict):
    """A call the model made in an earlier turn, replayed."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    """The result of a call, answering ``call_id``."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str
    id: str | None = None
    status: str | None = None


class ReasoningItem(_Strict):
    """Earlier reasoning, replayed by clients that keep it: accepted and left out of the
    prompt (chat templates drop past reasoning too)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class FunctionTool(_Strict):
    """Responses' flat function tool: ``{type, name, description, parameters, strict}``."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: str = Field(min_length=1)


class TextFormat(_Strict):
    """``text.format``: free text, any JSON object, or JSON under ``schema``."""

    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextOptions(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(_Strict):
    """The body of ``POST /v1/responses``."""

    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: JsonInt | None = _bounded("max_tokens")
    temperature: float | None = _bounded("temperature")
    top_p: float | None = _bounded("top_p")
    text: TextOptions | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    store: bool | None = None  # accepted either way: nothing is stored
    previous_response_id: str | None = Field(None, json_schema_extra={"enum": [None]})
    conversation: Any = Field(None, json_schema_extra={"enum": [None]})
    background: bool | None = Field(None, json_schema_extra={"enum": [False, None]})
    truncation: Literal["disabled"] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None  # effort/summary: the model decides
    slo_constraints: SLOConstraints | None = None  # ours, as on the chat routes

    def unsupported(self) -> tuple[str, str] | None:
        """The first field asking for what a stateless server cannot do: (field, why)."""
        for name in ("previous_response_id", "conversation"):
            if getattr(self, name) is not None:
                return name, (f"{name}: this server keeps no state (store: false "
                              "behaviour); send the whole conversation in input")
        if self.background:
            return "background", ("background: not supported (this server keeps no "
                                  "state to poll)")
        return None


def to_chat(body: ResponsesRequest) -> dict[str, Any]:
    """The chat-completions body that asks for the same generation."""
    chat: dict[str, Any] = {"model": body.model, "messages": messages(body),
                            "stream": body.stream}
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    for src, dst in (("max_output_tokens", "max_completion_tokens"),
                     ("temperature", "temperature"), ("top_p", "top_p"), ("user", "user"),
                     ("parallel_tool_calls", "parallel_tool_calls")):
        if getattr(body, src) is not None:
            chat[dst] = getattr(body, src)
    if body.slo_constraints is not None:
        chat["slo_constraints"] = body.slo_constraints.model_dump(exclude_none=True)
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type != "text":
        chat["response_format"] = _response_format(fmt)
    if body.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(
            exclude={"type"}, exclude_none=True)} for t in body.tools]
    if isinstance(body.tool_choice, FunctionChoice):
        chat["tool_choice"] = {"type": "function",
                               "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    return chat


def _response_format(fmt: TextFormat) -> dict[str, Any]:
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise FieldError("text.format.schema", "text.format.schema: required when type is "
                                               "json_schema")
    spec: dict[str, Any] = {"name": fmt.name or "response", "schema": fmt.schema_}
    if fmt.strict is not None:
        spec["strict"] = fmt.strict
    return {"type": "json_schema", "json_schema": spec}


def messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages of ``instructions`` and ``input``: consecutive function calls
    become one assistant message's ``tool_calls``, an output a ``tool`` message."""
    out: list[dict[str, Any]] = []
    if body.instructions is not None:
        out.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*out, {"role": "user", "content": body.input}]
    calls_of: dict[str, Any] | None = None  # the assistant message collecting calls
    for item in body.input:
        if isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if calls_of is None:
                calls_of = {"role": "assistant", "content": None, "tool_calls": []}
                out.append(calls_of)
            calls_of["tool_calls"].append(call)
            continue
        calls_of = None
        if isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        elif isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            content = item.content if isinstance(item.content, str) else "".join(
                p.text for p in item.content)
            out.append({"role": role, "content": content})
    if not out:
        raise FieldError("input", "input: holds no message")
    return out


# A chat field named by an error, as the Responses body spells it (first match wins).
_PARAMS = (
    (r"^max_completion_tokens|^max_tokens", "max_output_tokens"),
    (r"^messages.*", "input"),
    (r"^response_format(\.json_schema)?", "text.format"),
    (r"^structured_outputs.*", "text.format"),
    (r"^tools\[(\d+)\]\.function", r"tools[\1]"),
    (r"^tool_choice\.function", "tool_choice"),
)


def chat_param(param: str | None) -> str | None:
    """The Responses field behind chat field ``param`` (None stays None)."""
    if param is None:
        return None
    for pattern, repl in _PARAMS:
        if re.match(pattern, param):
            return re.sub(pattern, repl, param, count=1)
    return param
