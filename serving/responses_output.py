"""The Responses API's output, translated from the chat route's: a chat completion
becomes a ``response`` object, a chat chunk stream becomes OpenAI's event stream.

Output items: ``reasoning`` (from ``reasoning_content``), ``message`` (the text, one
``output_text`` part) and ``function_call`` (one per tool call; ``call_id`` is the chat
call's id). A response cut by its token budget has ``status: "incomplete"`` and
``incomplete_details.reason: "max_output_tokens"``; its stream still ends with
``response.completed`` (as vLLM's does), the event the official client's stream helper
waits for.

The stream, in order: ``response.created``, ``response.in_progress``; per item
``response.output_item.added``, then for a message ``response.content_part.added``,
``response.output_text.delta`` ... ``response.output_text.done``,
``response.content_part.done`` (reasoning alike, with ``response.reasoning_text.*``), or
for a call ``response.function_call_arguments.delta`` ... ``.done``; then
``response.output_item.done``; finally ``response.completed``. Each event carries its
``sequence_number``. A failure after the stream started is an ``error`` event followed
by ``response.failed``.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from serving.responses_schema import FunctionChoice, ResponsesRequest
from superinfer_jax.request import SamplingParams

_DEFAULTS = SamplingParams()


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_object(rid: str, body: ResponsesRequest, model: str, created: int,
                    status: str, output: list[dict[str, Any]],
                    usage: dict[str, Any] | None, incomplete: bool = False,
                    error: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``response`` object: the request's settings echoed, the output and usage."""
    fmt = body.text.format if body.text is not None and body.text.format else None
    choice = body.tool_choice
    return {
        "id": rid, "object": "response", "created_at": created, "status": status,
        "background": False, "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "model": model, "output": output,
        "parallel_tool_calls": True if body.parallel_tool_calls is None
        else body.parallel_tool_calls,
        "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
        "store": False,
        "temperature": _DEFAULTS.temperature if body.temperature is None
        else body.temperature,
        "text": {"format": {"type": "text"} if fmt is None
                 else fmt.model_dump(by_alias=True, exclude_none=True)},
        "tool_choice": choice.model_dump() if isinstance(choice, FunctionChoice)
        else choice or "auto",
        "tools": [t.model_dump(exclude_none=False) for t in body.tools or []],
        "top_p": _DEFAULTS.top_p if body.top_p is None else body.top_p,
        "truncation": "disabled", "usage": usage, "user": body.user,
        "metadata": body.metadata or {},
    }


def usage_of(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat usage in the Responses' terms."""
    if chat_usage is None:
        return None
    details = chat_usage.get("prompt_tokens_details") or {}
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0)},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def message_item(text: str, status: str = "completed",
                 item_id: str | None = None) -> dict[str, Any]:
    content = [] if status == "in_progress" else [_text_part(text)]
    return {"id": item_id or new_id("msg"), "type": "message", "status": status,
            "role": "assistant", "content": content}


def reasoning_item(text: str, status: str = "completed",
                   item_id: str | None = None) -> dict[str, Any]:
    content = [] if status == "in_progress" else [_reasoning_part(text)]
    return {"id": item_id or new_id("rs"), "type": "reasoning", "summary": [],
            "content": content, "status": status}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed",
              item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or new_id("fc"), "type": "function_call", "status": status,
            "call_id": call_id or new_id("call"), "name": name, "arguments": arguments}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def output_of(message: dict[str, Any], finish_reason: str | None) -> list[dict[str, Any]]:
    """A chat completion's message as output items."""
    out = []
    if message.get("reasoning_content"):
        out.append(reasoning_item(message["reasoning_content"]))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        status = "incomplete" if finish_reason == "length" else "completed"
        out.append(message_item(message.get("content") or "", status))
    for c in calls:
        fn = c.get("function") or {}
        out.append(call_item(c.get("id") or "", fn.get("name") or "",
                             fn.get("arguments") or ""))
    return out


def from_chat(rid: str, body: ResponsesRequest, chat: dict[str, Any]) -> dict[str, Any]:
    """A non-streamed chat completion as a ``response`` object."""
    choice = chat["choices"][0]
    incomplete = choice.get("finish_reason") == "length"
    obj = response_object(rid, body, chat["model"], int(time.time()),
                          "incomplete" if incomplete else "completed",
                          output_of(choice["message"], choice.get("finish_reason")),
                          usage_of(chat.get("usage")), incomplete)
    if "superinfer" in chat:
        obj["superinfer"] = chat["superinfer"]
    return obj


@dataclass
class _Open:
    """The output item being streamed: its place, its item, the text so far."""

    index: int
    item: dict[str, Any]
    text: str = ""
    tool_index: int | None = None


@dataclass
class EventStream:
    """Chat chunks in, Responses events (SSE text) out; ``start`` first, then ``chunk``
    for each chat chunk, then ``end``."""

    rid: str
    body: ResponsesRequest
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    seq: int = 0
    items: list[dict[str, Any]] = field(default_factory=list)
    open: _Open | None = None
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    extension: dict[str, Any] | None = None
    failed: bool = False

    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def _response(self, status: str, **kw: Any) -> dict[str, Any]:
        return response_object(self.rid, self.body, self.model, self.created, status,
                               list(self.items), self.usage, **kw)

    def start(self) -> list[str]:
        snapshot = self._response("in_progress")
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def chunk(self, chunk: dict[str, Any]) -> list[str]:
        """The events of one chat chunk (an ``error`` chunk fails the response)."""
        if "error" in chunk:
            return self._fail(chunk["error"])
        out: list[str] = []
        if chunk.get("usage"):
            self.usage = usage_of(chunk["usage"])
        if "superinfer" in chunk:
            self.extension = chunk["superinfer"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                out += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                out += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                out += self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return out

    def end(self) -> list[str]:
        """Close the open item and complete the response."""
        if self.failed:
            return []
        incomplete = self.finish_reason == "length"
        out: list[str] = []
        if not any(i["type"] in ("message", "function_call") for i in self.items) and \
                (self.open is None or self.open.item["type"] == "reasoning"):
            out += self._text("message", "")  # an empty answer is an empty message
        out += self._close("incomplete" if incomplete else "completed")
        final = self._response("incomplete" if incomplete else "completed",
                               incomplete=incomplete)
        if self.extension is not None:
            final["superinfer"] = self.extension
        return [*out, self._event("response.completed", response=final)]

    def _fail(self, error: dict[str, Any]) -> list[str]:
        self.failed = True
        err = {"code": error.get("code") or error.get("type") or "server_error",
               "message": error.get("message", "")}
        return [self._event("error", code=err["code"], message=err["message"],
                            param=error.get("param")),
                self._event("response.failed", response=self._response("failed", error=err))]

    def _text(self, kind: str, delta: str) -> list[str]:
        out: list[str] = []
        if self.open is None or self.open.item["type"] != kind:
            out += self._close("completed")
            item = (message_item if kind == "message" else reasoning_item)("", "in_progress")
            out += self._add(item)
            part = _text_part("") if kind == "message" else _reasoning_part("")
            out.append(self._event("response.content_part.added", **self._where(), part=part))
        assert self.open is not None
        self.open.text += delta
        name = "output_text" if kind == "message" else "reasoning_text"
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        out.append(self._event(f"response.{name}.delta", **self._where(), delta=delta,
                               **extra))
        return out

    def _call(self, call: dict[str, Any]) -> list[str]:
        out: list[str] = []
        index = call.get("index", 0)
        fn = call.get("function") or {}
        if self.open is None or self.open.tool_index != index:
            out += self._close("completed")
            out += self._add(call_item(call.get("id") or "", fn.get("name") or "", "",
                                       "in_progress"), tool_index=index)
        assert self.open is not None
        if fn.get("arguments"):
            self.open.text += fn["arguments"]
            out.append(self._event("response.function_call_arguments.delta",
                                   item_id=self.open.item["id"],
                                   output_index=self.open.index, delta=fn["arguments"]))
        return out

    def _add(self, item: dict[str, Any], tool_index: int | None = None) -> list[str]:
        self.open = _Open(len(self.items), item, tool_index=tool_index)
        return [self._event("response.output_item.added", output_index=self.open.index,
                            item=item)]

    def _where(self, o: _Open | None = None) -> dict[str, Any]:
        """Where a content event points: the item (``o``, else the open one), part 0."""
        o = o or self.open
        assert o is not None
        return {"item_id": o.item["id"], "output_index": o.index, "content_index": 0}

    def _close(self, status: str) -> list[str]:
        """The events that finish the open item, which joins the output."""
        o = self.open
        if o is None:
            return []
        self.open = None
        kind = o.item["type"]
        if kind == "function_call":
            item = {**o.item, "arguments": o.text, "status": "completed"}
            done = [self._event("response.function_call_arguments.done", item_id=item["id"],
                                output_index=o.index, name=item["name"],
                                arguments=o.text)]
        elif kind == "message":
            item, part = message_item(o.text, status, o.item["id"]), _text_part(o.text)
            done = [self._event("response.output_text.done", **self._where(o), text=o.text,
                                logprobs=[]),
                    self._event("response.content_part.done", **self._where(o), part=part)]
        else:
            item = reasoning_item(o.text, "completed", o.item["id"])
            part = _reasoning_part(o.text)
            done = [self._event("response.reasoning_text.done", **self._where(o),
                                text=o.text),
                    self._event("response.content_part.done", **self._where(o), part=part)]
        self.items.append(item)
        return [*done, self._event("response.output_item.done", output_index=o.index,
                                   item=item)]
