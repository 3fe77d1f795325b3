"""OpenAI request bodies (with vLLM's and our extensions) and the response shapes.

Types are checked strictly: a wrong type is a 400 naming the field. Unknown fields are
accepted and ignored, as vLLM does (clients send vendor extensions, e.g. guidellm's
``stream_options.continuous_usage_stats`` before we supported it); the server logs each
unknown name once, and ``server.strict_request_fields`` turns them into 400s instead
(``unknown_fields`` lists them). Fields OpenAI defines that this server cannot honour
(``suffix``, ``best_of`` other than ``n``) are accepted only at their neutral value and
refused otherwise.

Numeric bounds are not checked here but by the engine's request dataclasses
(``superinfer_jax.request.FIELD_RANGES``), the one place they are written; the models
carry them into the published OpenAPI document (``json_schema_extra``) so clients and
fuzzers see the same bounds.

Extensions: ``slo_constraints: {ttft_ms, tbt_ms, priority_class}``, and vLLM's ``top_k``,
``ignore_eos``, ``stop_token_ids``, ``repetition_penalty``, ``min_tokens``,
``speculative`` (ours: false opts out of speculative decoding), ``structured_outputs``
and ``stream_options.continuous_usage_stats``. Responses carry a
``superinfer`` object (TTFT, queue time, rotations, SLO outcome, the engine's own finish
reason), which OpenAI clients keep as an extra field.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from serving.requests import CHAT_ROLES, RequestSummary
from superinfer_jax.request import (
    FIELD_RANGES,
    MAX_CACHE_SALT_CHARS,
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    PRIORITY_CLASSES,
    FieldError,
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


# Most choices (``n``) per prompt: ``server.max_n`` sets it (the published schema shows
# the server's value).
DEFAULT_MAX_N = 16
# Prompts in one completions request (a list of strings or of token-id lists).
MAX_PROMPTS = 256


class JsonSchemaFormat(_Strict):
    """OpenAI's ``response_format.json_schema``. ``strict`` is accepted either way: the
    output is always held to the schema (constrained decoding)."""

    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """``schema`` beside ``json_object`` (instructor's JSON_SCHEMA mode, vLLM's): the
    object is held to that schema."""

    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")


class FunctionDef(_Strict):
    """A function the model may call: its arguments' JSON schema in ``parameters``
    (checked by ``serving.tools``, which names the field)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs``: exactly one constraint. ``json`` is a JSON schema
    (an object, or its JSON text); ``choice`` the output is one of these strings;
    ``grammar`` a Lark (EBNF-like) grammar; ``json_object`` any JSON object."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None
    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)

    def constraint(self) -> tuple[str, Any]:
        """(kind, value) of the one constraint set; ``FieldError`` unless exactly one."""
        given: list[tuple[str, Any]] = [
            (k, v) for k, v in (("json", self.json_), ("regex", self.regex),
                                ("choice", self.choice), ("grammar", self.grammar))
            if v is not None]
        if self.json_object:
            given.append(("json_object", None))
        if len(given) != 1:
            names = [k for k, _ in given] or "none"
            raise FieldError("structured_outputs", "structured_outputs: give exactly one of "
                             f"json, regex, choice, grammar, json_object (got {names})")
        kind, value = given[0]
        if kind == "json" and isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise FieldError("structured_outputs.json",
                                 f"structured_outputs.json: not valid JSON: {e}") from e
        if kind == "json" and not isinstance(value, dict | bool):
            raise FieldError("structured_outputs.json", "structured_outputs.json: a JSON "
                             f"schema is an object, got {type(value).__name__}")
        return kind, value


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
    speculative: bool = True  # false: this request opts out of speculative decoding
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: JsonInt = Field(1, json_schema_extra={"minimum": 1, "maximum": DEFAULT_MAX_N})
    user: str | None = None
    presence_penalty: float | None = _bounded("presence_penalty")
    frequency_penalty: float | None = _bounded("frequency_penalty")
    repetition_penalty: float | None = _bounded("repetition_penalty")  # vLLM's
    min_tokens: JsonInt | None = _bounded("min_tokens")  # vLLM's
    # OpenAI's: token id (as a string) -> bias added to its logit
    logit_bias: dict[str, float] | None = Field(None, json_schema_extra={
        "maxProperties": MAX_LOGIT_BIAS, "propertyNames": {"pattern": "^[0-9]+$"},
        "additionalProperties": FIELD_RANGES["logit_bias"].json_schema()})
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's
    slo_constraints: SLOConstraints | None = None
    # vLLM's: requests share cached prefix pages only with the same salt (a tenant's
    # secret; a shared cache is a timing side channel between tenants)
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)

    def unsupported(self) -> tuple[str, str] | None:
        """The first field set to something this server cannot do: (field, why)."""
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options: only allowed when stream is true"
        return None

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, bias) pairs; a key that is not a token id is a
        ``FieldError`` (values and ids in the vocabulary are checked by the engine)."""
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()) or len(key) > 10:
                raise FieldError("logit_bias", "logit_bias: keys are token ids (decimal "
                                 f"integers as strings), got {key[:40]!r}")
            pairs.append((int(key), bias))
        return tuple(pairs)

    def structured(self) -> tuple[str, str, Any] | None:
        """The output constraint asked for: (the field the client used, kind, value) with
        kind json, json_object, regex, choice or grammar; None for free text."""
        rf, so = self.response_format, self.structured_outputs
        if rf is not None and rf.type != "text" and so is not None:
            raise FieldError("structured_outputs", "structured_outputs: give either it or "
                             "response_format, not both")
        if so is not None:
            kind, value = so.constraint()
            return f"structured_outputs.{kind}", kind, value
        if rf is None or rf.type == "text":
            return None
        if rf.type == "json_object":
            if rf.schema_ is not None:
                return "response_format.schema", "json", rf.schema_
            return "response_format", "json_object", None
        if rf.json_schema is None:
            raise FieldError("response_format.json_schema", "response_format.json_schema: "
                             "required when type is json_schema")
        schema = rf.json_schema.schema_
        # OpenAI: no schema means any JSON object
        return ("response_format.json_schema", "json", schema) if schema is not None else (
            "response_format.json_schema", "json_object", None)


class CompletionRequest(_Common):
    prompt: str | list[JsonInt] | list[str] | list[list[JsonInt]]
    # 0 only with echo (scoring the prompt, as vLLM allows)
    max_tokens: JsonInt | None = Field(None, json_schema_extra={
        "minimum": 0, "maximum": FIELD_RANGES["max_tokens"].high})
    echo: bool = False
    logprobs: JsonInt | None = _bounded("logprobs")
    suffix: str | None = Field(None, **_only("", None))
    # best_of > n (sample more, return the n most likely) is not offered: vLLM V1 and
    # OpenAI's newer models dropped it; best_of == n is plain n
    best_of: JsonInt | None = Field(None, json_schema_extra={
        "minimum": 1, "maximum": DEFAULT_MAX_N, "description": "only equal to n"})

    def unsupported(self) -> tuple[str, str] | None:
        if self.suffix:
            return "suffix", "suffix: not supported"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", (f"best_of: only best_of == n is supported (got best_of "
                               f"{self.best_of}, n {self.n}); ask for n samples instead")
        return super().unsupported()


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: JsonInt | None = _bounded("max_tokens")
    logprobs: bool | None = None
    top_logprobs: JsonInt | None = _bounded("logprobs")
    tools: list[ToolDef] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def tool_fields(self) -> tuple[list[dict[str, Any]] | None, Any, bool | None]:
        """``tools``, ``tool_choice``, ``parallel_tool_calls`` as plain JSON, for
        ``serving.tools.plan_output``."""
        tools = None if self.tools is None else [
            t.model_dump(exclude_none=True) for t in self.tools]
        choice = self.tool_choice
        if isinstance(choice, BaseModel):
            choice = choice.model_dump()
        return tools, choice, self.parallel_tool_calls

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs: only allowed when logprobs is true"
        return super().unsupported()


class TokenizeRequest(_Strict):
    """vLLM's ``/tokenize``: a prompt, or chat messages rendered with the chat template.
    ``add_special_tokens`` defaults as vLLM's do: true for a prompt (the BOS the model
    wants, if any), false for messages (templates write their own)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    """vLLM's ``/detokenize``: token ids back to text."""

    model: str | None = None
    tokens: list[JsonInt] = Field(json_schema_extra={
        "items": {"type": "integer", **FIELD_RANGES["stop_token_ids"].json_schema()}})


# The engine's finish reasons as OpenAI's. An aborted request (client cancel, drain
# grace over) was cut short, which OpenAI clients read from "length" (the text is
# incomplete), never from "stop" (it ended by itself); the engine's own reason stays in
# ``superinfer.finish_reason``.
_OPENAI_FINISH = {"stop": "stop", "length": "length", "abort": "length"}


def openai_finish_reason(reason: str) -> str:
    return _OPENAI_FINISH.get(reason, "stop")


def usage_json(prompt_tokens: int, completion_tokens: int,
               cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage, with the prompt tokens served from the prefix cache."""
    return {**usage_counts(prompt_tokens, completion_tokens),
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def usage_counts(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass
class ChoiceResult:
    """One finished choice of a non-streamed response. ``text`` is what the client gets
    (the prompt in front with ``echo``), ``logprobs`` already in the endpoint's shape."""

    index: int
    text: str
    finish_reason: str  # the engine's
    logprobs: dict[str, Any] | None
    summary: RequestSummary
    message: dict[str, Any] | None = None  # chat: the parsed message (tools, reasoning)
    openai_finish: str | None = None  # chat: OpenAI's reason when parsing decided it


def completion_json(rid: str, model: str, choices: Sequence[ChoiceResult],
                    usage: dict[str, Any]) -> dict[str, Any]:
    return _response(rid, model, "text_completion", [
        {"index": c.index, "text": c.text, "logprobs": c.logprobs,
         "finish_reason": openai_finish_reason(c.finish_reason)} for c in choices],
        choices, usage)


def chat_json(rid: str, model: str, choices: Sequence[ChoiceResult],
              usage: dict[str, Any]) -> dict[str, Any]:
    return _response(rid, model, "chat.completion", [
        {"index": c.index, "message": c.message or {"role": "assistant", "content": c.text},
         "logprobs": c.logprobs,
         "finish_reason": c.openai_finish or openai_finish_reason(c.finish_reason)}
        for c in choices], choices, usage)


def _response(rid: str, model: str, kind: str, bodies: list[dict[str, Any]],
              choices: Sequence[ChoiceResult], usage: dict[str, Any]) -> dict[str, Any]:
    """The top-level ``superinfer`` is the first choice's; with several choices each
    carries its own too."""
    if len(choices) > 1:
        for body, c in zip(bodies, choices, strict=True):
            body["superinfer"] = c.summary.to_json()
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model,
            "choices": bodies, "usage": usage, "superinfer": choices[0].summary.to_json()}


def chunk_json(rid: str, model: str, chat: bool, text: str | None,
               finish_reason: str | None = None, first: bool = False,
               with_usage_field: bool = False,
               usage: dict[str, int] | None = None, index: int = 0,
               logprobs: dict[str, Any] | None = None,
               delta_fields: dict[str, Any] | None = None) -> dict[str, Any]:
    """One SSE chunk of choice ``index`` with a text delta (chat: a ``delta`` object) and
    the logprobs of its tokens. ``usage`` is the choice's running count under
    ``continuous_usage_stats``; else the field is null when asked. ``delta_fields``: a
    parsed chat delta (``reasoning_content``, ``tool_calls``) instead of ``text``;
    a ``finish_reason`` of ``tool_calls`` is OpenAI's already."""
    if finish_reason is not None and finish_reason != "tool_calls":
        finish_reason = openai_finish_reason(finish_reason)
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        delta.update(delta_fields or {})
        choice = {"index": index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs,
                  "finish_reason": finish_reason}
    body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice]}
    if with_usage_field or usage is not None:
        body["usage"] = usage
    return body


def usage_chunk_json(rid: str, model: str, chat: bool, usage: dict[str, Any],
                     s: RequestSummary) -> dict[str, Any]:
    """The last chunk under ``stream_options.include_usage``: no choices, the usage (of
    every choice), the first choice's ``superinfer``."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [],
            "usage": usage, "superinfer": s.to_json()}


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                404: "not_found_error", 405: "invalid_request_error",
                413: "invalid_request_error", 429: "rate_limit_error",
                503: "service_unavailable_error"}


def error_json(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"),
                      "param": param, "code": code}}
