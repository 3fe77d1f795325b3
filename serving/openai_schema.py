"""OpenAI request bodies (with vLLM's and our extensions) and the response shapes.

Types are checked strictly: a wrong type is a 400 naming the field. Unknown fields are
accepted and ignored, as vLLM does (clients send vendor extensions, e.g. guidellm's
``stream_options.continuous_usage_stats`` before we supported it); the server logs each
unknown name once, and ``server.strict_request_fields`` turns them into 400s instead
(``unknown_fields`` lists them). Fields OpenAI defines that this server cannot honour
(``n > 1``, logprobs, penalties) are accepted only at their neutral value and refused
otherwise.

Numeric bounds are not checked here but by the engine's request dataclasses
(``superinfer_jax.request.FIELD_RANGES``), the one place they are written; the models
carry them into the published OpenAPI document (``json_schema_extra``) so clients and
fuzzers see the same bounds.

Extensions: ``slo_constraints: {ttft_ms, tbt_ms, priority_class}``, and vLLM's ``top_k``,
``ignore_eos``, ``stop_token_ids`` and ``stream_options.continuous_usage_stats``.
Responses carry a ``superinfer`` object (TTFT, queue time, rotations, SLO outcome, the
engine's own finish reason), which OpenAI clients keep as an extra field.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from serving.requests import CHAT_ROLES, RequestSummary
from superinfer_jax.request import (
    FIELD_RANGES,
    MAX_CACHE_SALT_CHARS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    PRIORITY_CLASSES,
)


class _Strict(BaseModel):
    """Strict types; unknown fields kept in ``model_extra`` (see ``unknown_fields``)."""

    model_config = ConfigDict(extra="allow", strict=True)


def _integral(value: Any) -> Any:
    """JSON has one number type: ``5.0`` is the integer 5 (JSON Schema agrees), while
    ``5.5`` and ``"5"`` stay what they are and fail the strict int check."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


JsonInt = Annotated[int, BeforeValidator(_integral)]


def _bounded(name: str) -> Any:
    """An optional numeric field carrying the engine's bounds into the OpenAPI document."""
    return Field(None, json_schema_extra=FIELD_RANGES[name].json_schema())


def _only(*values: Any) -> Any:
    """A field this server accepts only at its neutral value(s): the OpenAPI document says
    so (``enum``), so clients and fuzzers know; other values get a 400 naming the field."""
    return {"json_schema_extra": {"enum": list(values)}}


def unknown_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """Paths of the fields the schema does not know, recursively, spelled as the body
    spells them (``stream_options.continuous_usage_stats``, ``messages[0].audio``)."""
    found = [f"{prefix}{k}" for k in (model.model_extra or {})]
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for i, item in items:
            if isinstance(item, BaseModel):
                path = f"{prefix}{name}." if i is None else f"{prefix}{name}[{i}]."
                found += unknown_fields(item, path)
    return found


class SLOConstraints(_Strict):
    ttft_ms: float | None = _bounded("slo.ttft_ms")
    tbt_ms: float | None = _bounded("slo.tbt_ms")
    priority_class: str | None = Field(None, json_schema_extra={"enum": list(PRIORITY_CLASSES)})


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    """``content`` may be null on an assistant message (one that carries tool calls);
    a ``tool`` message answers the call named by ``tool_call_id``."""

    role: str = Field(json_schema_extra={"enum": list(CHAT_ROLES)})
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def to_template(self) -> dict[str, Any]:
        """What the chat template gets: the fields set, extensions left out."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if isinstance(self.content, list):
            out["content"] = [p.model_dump(include={"type", "text"}) for p in self.content]
        for name in ("name", "tool_call_id"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.tool_calls is not None:
            out["tool_calls"] = [
                {"id": c.id, "type": c.type,
                 "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for c in self.tool_calls]
        return out


class _Common(_Strict):
    model: str
    max_tokens: JsonInt | None = _bounded("max_tokens")
    temperature: float | None = _bounded("temperature")
    top_p: float | None = _bounded("top_p")
    top_k: JsonInt | None = _bounded("top_k")
    seed: JsonInt | None = _bounded("seed")
    stop: str | list[str] | None = Field(None, json_schema_extra={
        "maxItems": MAX_STOP_STRINGS, "maxLength": MAX_STOP_CHARS})
    stop_token_ids: list[JsonInt] | None = Field(
        None, json_schema_extra={"maxItems": MAX_STOP_TOKEN_IDS, "items": {"type": "integer",
                                           **FIELD_RANGES["stop_token_ids"].json_schema()}})
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: JsonInt = Field(1, **_only(1))
    user: str | None = None
    presence_penalty: float | None = Field(None, **_only(0, None))
    frequency_penalty: float | None = Field(None, **_only(0, None))
    logit_bias: dict[str, float] | None = Field(None, **_only({}, None))
    slo_constraints: SLOConstraints | None = None
    # vLLM's: requests share cached prefix pages only with the same salt (a tenant's
    # secret; a shared cache is a timing side channel between tenants)
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)

    def unsupported(self) -> tuple[str, str] | None:
        """The first field set to something this server cannot do: (field, why)."""
        if self.n != 1:
            return "n", "n: only n=1 is supported"
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                return name, f"{name}: penalties are not supported (use 0 or omit it)"
        if self.logit_bias:
            return "logit_bias", "logit_bias: not supported"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options: only allowed when stream is true"
        return None


class CompletionRequest(_Common):
    prompt: str | list[JsonInt] | list[str] | list[list[JsonInt]]
    echo: bool = Field(False, **_only(False))
    logprobs: JsonInt | None = Field(None, **_only(0, None))
    suffix: str | None = Field(None, **_only("", None))
    best_of: JsonInt | None = Field(None, **_only(1, None))

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo: not supported"
        if self.logprobs:
            return "logprobs", "logprobs: not supported"
        if self.suffix:
            return "suffix", "suffix: not supported"
        if self.best_of not in (None, 1):
            return "best_of", "best_of: only 1 is supported"
        return super().unsupported()


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: JsonInt | None = _bounded("max_tokens")
    logprobs: bool | None = Field(None, **_only(False, None))
    top_logprobs: JsonInt | None = Field(None, **_only(0, None))

    def unsupported(self) -> tuple[str, str] | None:
        for name in ("logprobs", "top_logprobs"):
            if getattr(self, name):
                return name, f"{name}: not supported"
        return super().unsupported()


# The engine's finish reasons as OpenAI's. An aborted request (client cancel, drain
# grace over) was cut short, which OpenAI clients read from "length" (the text is
# incomplete), never from "stop" (it ended by itself); the engine's own reason stays in
# ``superinfer.finish_reason``.
_OPENAI_FINISH = {"stop": "stop", "length": "length", "abort": "length"}


def openai_finish_reason(reason: str) -> str:
    return _OPENAI_FINISH.get(reason, "stop")


def usage_json(s: RequestSummary) -> dict[str, Any]:
    """OpenAI's usage, with the prompt tokens served from the prefix cache."""
    return {**usage_counts(s.prompt_tokens, s.completion_tokens),
            "prompt_tokens_details": {"cached_tokens": s.cached_prompt_tokens}}


def usage_counts(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_json(rid: str, model: str, s: RequestSummary) -> dict[str, Any]:
    return {
        "id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "text": s.text, "logprobs": None,
                     "finish_reason": openai_finish_reason(s.finish_reason)}],
        "usage": usage_json(s), "superinfer": s.to_json(),
    }


def chat_json(rid: str, model: str, s: RequestSummary) -> dict[str, Any]:
    return {
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": s.text},
                     "logprobs": None, "finish_reason": openai_finish_reason(s.finish_reason)}],
        "usage": usage_json(s), "superinfer": s.to_json(),
    }


def chunk_json(rid: str, model: str, chat: bool, text: str | None,
               finish_reason: str | None = None, first: bool = False,
               with_usage_field: bool = False,
               usage: dict[str, int] | None = None) -> dict[str, Any]:
    """One SSE chunk with a text delta (chat: a ``delta`` object). ``usage`` is the
    running count under ``continuous_usage_stats``; else the field is null when asked."""
    if finish_reason is not None:
        finish_reason = openai_finish_reason(finish_reason)
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None,
                  "finish_reason": finish_reason}
    body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice]}
    if with_usage_field or usage is not None:
        body["usage"] = usage
    return body


def usage_chunk_json(rid: str, model: str, chat: bool, s: RequestSummary) -> dict[str, Any]:
    """The last chunk under ``stream_options.include_usage``: no choices, the usage."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [],
            "usage": usage_json(s), "superinfer": s.to_json()}


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                404: "not_found_error", 405: "invalid_request_error",
                413: "invalid_request_error", 429: "rate_limit_error",
                503: "service_unavailable_error"}


def error_json(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"),
                      "param": param, "code": code}}
