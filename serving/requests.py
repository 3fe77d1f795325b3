"""What every front (gRPC, HTTP, batch) shares: turning a client's request into engine
inputs, and a finished request into the numbers clients and metrics report.

Each front parses its own wire format, then calls these, so a prompt, a sampling knob or
an SLO means the same thing, and fails with the same message, whichever way it arrived.
"""

from __future__ import annotations

import importlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from superinfer_jax.request import (
    FIELD_RANGES,
    SEED_MAX,
    SLO,
    FieldError,
    Request,
    SamplingParams,
)

CHAT_ROLES = ("system", "user", "assistant", "tool")


def encode_prompt(tokenizer: Any, *, text: str | None = None,
                  token_ids: Sequence[int] | None = None,
                  messages: Sequence[Any] | None = None,
                  add_generation_prompt: bool = True,
                  tools: Sequence[Any] | None = None) -> list[int]:
    """Token ids of exactly one of: raw text, pre-tokenized ids, chat messages.

    Errors are ``FieldError``s naming the field as the gRPC schema spells it (``text``,
    ``token_ids``, ``messages[i].role``); the HTTP front maps them to its own names."""
    given = [n for n, v in (("text", text), ("token_ids", token_ids), ("messages", messages))
             if v is not None]
    if not given:
        raise FieldError("prompt",
                         "a prompt is required: give prompt text, token ids or messages")
    if len(given) > 1:
        raise FieldError(given[1], f"give only one of text, token_ids, messages (got {given})")
    if token_ids is not None:
        ids = list(token_ids)
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise FieldError("token_ids", f"token ids must be integers, got {t!r}")
        if not ids:
            raise FieldError("token_ids", "token_ids must not be empty")
        return ids
    field = "messages" if messages is not None else "text"
    if tokenizer is None:
        raise FieldError(field, "this model has no tokenizer: send token ids")
    if messages is not None:
        text = render_chat(tokenizer, messages, add_generation_prompt, tools)
    if not isinstance(text, str):
        raise FieldError(field, f"prompt must be a string, got {type(text).__name__}")
    if not text:
        raise FieldError(field, "prompt must not be empty")
    return list(tokenizer.encode(text))


def render_chat(tokenizer: Any, messages: Sequence[Any],
                add_generation_prompt: bool = True, tools: Sequence[Any] | None = None) -> str:
    """The prompt text of OpenAI-style messages, through the model's chat template.

    Assistant messages may carry ``tool_calls`` (then ``content`` may be null) and tool
    messages a ``tool_call_id``; tool calls need a template that renders them (one that
    mentions ``tool_calls``), else they are refused rather than silently dropped."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise FieldError("messages", "messages must be a non-empty list")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise FieldError(f"messages[{i}]",
                             f"messages[{i}] must be an object with role and content")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise FieldError(f"messages[{i}].role",
                             f"messages[{i}].role must be one of {list(CHAT_ROLES)}, got {role!r}")
        message = {"role": role, "content": _content_text(i, role, m)}
        if m.get("tool_calls") is not None:
            if role != "assistant":
                raise FieldError(f"messages[{i}].tool_calls",
                                 f"messages[{i}].tool_calls: only assistant messages carry them")
            if not _template_renders_tools(tokenizer):
                raise FieldError(f"messages[{i}].tool_calls",
                                 f"messages[{i}].tool_calls: this model's chat template does "
                                 "not render tool calls")
            message["tool_calls"] = m["tool_calls"]
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                message[key] = m[key]
        clean.append(message)
    try:
        extra = {} if tools is None else {"tools": list(tools)}
        return tokenizer.apply_chat_template(clean,
                                             add_generation_prompt=add_generation_prompt,
                                             **extra)
    except Exception as e:  # a template's own raise_exception, or a missing template
        raise FieldError("messages", f"messages: chat template failed: {e}") from e


def _template_renders_tools(tokenizer: Any) -> bool:
    return "tool_calls" in (getattr(tokenizer, "chat_template", None) or "")


def _content_text(i: int, role: str, message: dict[str, Any]) -> str:
    """OpenAI content: a string, or a list of ``{"type": "text", "text": ...}`` parts; null
    (or absent) only on an assistant message, which then carries tool calls."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise FieldError(
                    f"messages[{i}].content[{j}]",
                    f"messages[{i}].content[{j}] must be a text part "
                    '({"type": "text", "text": "..."}); other parts are not supported')
            parts.append(part["text"])
        return "".join(parts)
    raise FieldError(f"messages[{i}].content",
                     f"messages[{i}].content must be a string, got {type(content).__name__}")


def make_sampling(**fields: Any) -> SamplingParams:
    """SamplingParams from the fields a client set (None means unset: the default)."""
    return SamplingParams(**{k: v for k, v in fields.items() if v is not None})


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of ``n`` (vLLM's): ``seed + index``, wrapping at 2**64,
    so each sample is reproducible by its own seed and the n samples differ."""
    if seed is None or index == 0:  # as sent: an out-of-range seed is refused, not wrapped
        return seed
    return (seed + index) % (SEED_MAX + 1)


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def structured_spec(kind: str, value: Any, field: str) -> Any:
    """The engine's output constraint (``superinfer_jax.structured.StructuredOutputSpec``)
    for ``kind`` and ``value``. ``field`` is the request field it came from, named by the
    ``FieldError`` when this build has no structured-output support. The grammar itself
    is compiled by the engine at intake; a schema or regex it cannot compile comes back
    as a ``FieldError`` on ``structured_outputs.<kind>``."""
    if kind not in STRUCTURED_KINDS:
        raise FieldError(field, f"{field}: unknown kind {kind!r}")
    try:
        module = importlib.import_module("superinfer_jax.structured")
    except ImportError:
        raise FieldError(field, f"{field}: structured outputs are not available in this "
                                "build") from None
    if kind == "json" and not isinstance(value, str):
        value = json.dumps(value, ensure_ascii=False)  # key order kept: it orders the output
    return module.StructuredOutputSpec(kind, value)


def make_slo(default: SLO, ttft_ms: float | None = None, tbt_ms: float | None = None,
             priority_class: str | None = None) -> SLO:
    """A request's SLO: what it asked for, the server default for what it left out."""
    return SLO(
        ttft_ms=default.ttft_ms if ttft_ms is None else ttft_ms,
        tbt_ms=default.tbt_ms if tbt_ms is None else tbt_ms,
        priority_class=default.priority_class if priority_class is None else priority_class,
    )


# SLO headers, by field, highest precedence first: llm-d's endpoint picker forwards
# ``x-llm-d-slo-*``; ``x-slo-*`` are the older names. ``tpot`` is our ``tbt_ms``.
SLO_HEADERS: dict[str, tuple[str, ...]] = {
    "ttft_ms": ("x-llm-d-slo-ttft-ms", "x-slo-ttft-ms"),
    "tbt_ms": ("x-llm-d-slo-tpot-ms", "x-slo-tpot-ms"),
}
_MAX_HEADER_SHOWN = 40


def slo_from_headers(get: Callable[[str], str | None]) -> dict[str, float]:
    """The SLO fields the headers set (``ttft_ms``, ``tbt_ms``), ``get`` reading one
    header by its lowercase name. For each field the llm-d header wins over the older one.
    A value that is not a finite number in the SLO field's range is a ``FieldError``
    whose ``field`` is the header's name (even when the winning header is valid: a
    client sending a malformed header should hear of it)."""
    out: dict[str, float] = {}
    for field, names in SLO_HEADERS.items():
        for name in names:
            raw = get(name)
            if raw is None:
                continue
            value = _header_ms(name, raw, FIELD_RANGES[f"slo.{field}"])
            out.setdefault(field, value)
    return out


def _header_ms(name: str, raw: str, bounds: Any) -> float:
    text = raw.strip()
    shown = repr(text if len(text) <= _MAX_HEADER_SHOWN else text[:_MAX_HEADER_SHOWN] + "...")
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise FieldError(name, f"header {name} must be a finite number of milliseconds, "
                               f"got {shown}")
    try:
        bounds.check(name, value)
    except FieldError as e:
        raise FieldError(name, f"header {e}") from None
    return value


def merge_slo(default: SLO, headers: dict[str, float], ttft_ms: float | None = None,
              tbt_ms: float | None = None, priority_class: str | None = None) -> SLO:
    """``make_slo`` with the headers' fields under the body's: field by field, the body
    wins, then the header, then the server default."""
    return make_slo(default, headers.get("ttft_ms") if ttft_ms is None else ttft_ms,
                    headers.get("tbt_ms") if tbt_ms is None else tbt_ms, priority_class)


@dataclass(frozen=True)
class RequestSummary:
    """One finished request, in the units clients read (milliseconds, token counts).

    TBT is judged on the mean gap between tokens (time per output token, as DistServe
    and most SLO-attainment studies do): one slow step after a rotation does not fail a
    request whose stream kept pace overall. ``None`` means "not measurable": no token
    (TTFT) or fewer than two (TBT).
    """

    req_id: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    text: str
    ttft_ms: float | None
    queue_time_ms: float | None
    e2e_ms: float
    mean_tbt_ms: float | None
    num_rotations: int
    num_preemptions: int
    slo: SLO
    ttft_met: bool | None
    tbt_met: bool | None
    cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def slo_met(self) -> bool:
        return self.ttft_met is not False and self.tbt_met is not False

    @classmethod
    def from_request(cls, req: Request) -> RequestSummary:
        end = req.transitions[-1][0] if req.status.is_finished else time.perf_counter()
        ttft = req.ttft
        gaps = req.inter_token_gaps
        mean_tbt = sum(gaps) / len(gaps) if gaps else None
        if ttft is not None:
            ttft_met: bool | None = ttft * 1000 <= req.slo.ttft_ms
        else:  # no token: a violation only if the wait already exceeded the target
            ttft_met = False if (end - req.arrival_time) * 1000 > req.slo.ttft_ms else None
        queue = req.first_scheduled_time
        return cls(
            req_id=req.req_id,
            finish_reason=req.status.finish_reason or "abort",
            prompt_tokens=len(req.prompt_token_ids),
            completion_tokens=len(req.output_token_ids),
            text=req.output_text,
            ttft_ms=None if ttft is None else ttft * 1000,
            queue_time_ms=None if queue is None else (queue - req.arrival_time) * 1000,
            e2e_ms=(end - req.arrival_time) * 1000,
            mean_tbt_ms=None if mean_tbt is None else mean_tbt * 1000,
            num_rotations=req.num_rotations,
            num_preemptions=req.num_preemptions,
            slo=req.slo,
            ttft_met=ttft_met,
            tbt_met=None if mean_tbt is None else mean_tbt * 1000 <= req.slo.tbt_ms,
            cached_prompt_tokens=req.num_cached_tokens,
        )

    def to_json(self) -> dict[str, Any]:
        """The ``superinfer`` extension object of HTTP responses and batch results."""
        return {
            "finish_reason": self.finish_reason,
            "ttft_ms": _round(self.ttft_ms),
            "queue_time_ms": _round(self.queue_time_ms),
            "e2e_ms": _round(self.e2e_ms),
            "mean_tbt_ms": _round(self.mean_tbt_ms),
            "num_rotations": self.num_rotations,
            "num_preemptions": self.num_preemptions,
            "slo": {"ttft_ms": self.slo.ttft_ms, "tbt_ms": self.slo.tbt_ms,
                    "priority_class": self.slo.priority_class,
                    "ttft_met": self.ttft_met, "tbt_met": self.tbt_met, "met": self.slo_met},
        }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)
