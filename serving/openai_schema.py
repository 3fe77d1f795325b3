"""OpenAI request bodies (with vLLM's and our extensions) and the response shapes.

Requests are parsed strictly: an unknown field or a wrong type is a 400 naming it, never
silently ignored (a misspelt ``max_token`` would otherwise generate 16 tokens without a
word). Fields OpenAI defines that this server cannot honour (``n > 1``, logprobs,
penalties) are accepted only at their neutral value and refused otherwise.

Extensions: ``slo_constraints: {ttft_ms, tbt_ms, priority_class}``, and vLLM's ``top_k``,
``ignore_eos`` and ``stop_token_ids``. Responses carry a ``superinfer`` object (TTFT,
queue time, rotations, SLO outcome), which OpenAI clients keep as an extra field.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from serving.requests import RequestSummary


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class SLOConstraints(_Strict):
    ttft_ms: float | None = None
    tbt_ms: float | None = None
    priority_class: str | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: str
    content: str | list[TextPart]
    name: str | None = None


class _Common(_Strict):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    slo_constraints: SLOConstraints | None = None

    def unsupported(self) -> str | None:
        """The first field set to something this server cannot do, with why."""
        if self.n != 1:
            return "n: only n=1 is supported"
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                return f"{name}: penalties are not supported (use 0 or omit it)"
        if self.logit_bias:
            return "logit_bias: not supported"
        if self.stream_options is not None and not self.stream:
            return "stream_options: only allowed when stream is true"
        return None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo: not supported"
        if self.logprobs:
            return "logprobs: not supported"
        if self.suffix:
            return "suffix: not supported"
        if self.best_of not in (None, 1):
            return "best_of: only 1 is supported"
        return super().unsupported()


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def unsupported(self) -> str | None:
        if self.logprobs or self.top_logprobs:
            return "logprobs: not supported"
        return super().unsupported()


def usage_json(s: RequestSummary) -> dict[str, int]:
    return {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens,
            "total_tokens": s.prompt_tokens + s.completion_tokens}


def completion_json(rid: str, model: str, s: RequestSummary) -> dict[str, Any]:
    return {
        "id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "text": s.text, "logprobs": None,
                     "finish_reason": s.finish_reason}],
        "usage": usage_json(s), "superinfer": s.to_json(),
    }


def chat_json(rid: str, model: str, s: RequestSummary) -> dict[str, Any]:
    return {
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": s.text},
                     "logprobs": None, "finish_reason": s.finish_reason}],
        "usage": usage_json(s), "superinfer": s.to_json(),
    }


def chunk_json(rid: str, model: str, chat: bool, text: str | None,
               finish_reason: str | None = None, first: bool = False,
               with_usage_field: bool = False) -> dict[str, Any]:
    """One SSE chunk with a text delta (chat: a ``delta`` object)."""
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
    if with_usage_field:
        body["usage"] = None
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
