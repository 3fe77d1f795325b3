"""Schemathesis hooks of ``test_openapi_conformance`` (loaded through
``SCHEMATHESIS_HOOKS``).

The document says what JSON Schema can say (``serving.openapi_doc``); what depends on
content is checked by the server alone. A *positive* case (one the document accepts) is
steered away from those content rules here, each named below, so that "valid data is
accepted" holds for what the document promises; negative cases are sent as generated.
Every case's in-range token budget is lowered to 4, and its prompts shortened and
counted down: cost only (still valid), so the run stays within its time budget.
"""

from __future__ import annotations

from typing import Any

import schemathesis

BUDGET = 4
MAX_TEXT = 12  # characters of a prompt or message: its tokens must fit max_model_len
MAX_ITEMS = 3  # prompts, messages, input items, token ids kept
# the fields that set a token budget, the one that wins first (chat: the newer name)
_BUDGET_FIELDS = ("max_completion_tokens", "max_output_tokens", "max_tokens")
_BUDGET_OF = {"/v1/completions": "max_tokens", "/v1/chat/completions": "max_completion_tokens",
              "/v1/responses": "max_output_tokens"}


@schemathesis.hook
def before_call(ctx: Any, case: Any, kwargs: Any) -> None:
    body = case.body
    if not isinstance(body, dict):
        return
    for key in _BUDGET_FIELDS:
        value = _integer(body.get(key))
        if value is not None and value > BUDGET:
            body[key] = BUDGET
    field = _BUDGET_OF.get(case.operation.path)
    if field and all(body.get(k) is None for k in _BUDGET_FIELDS):
        body[field] = BUDGET  # chat's default budget is the whole context
    meta = case.meta
    if meta is not None and meta.generation.mode.is_positive:
        steer(body)


def steer(body: dict[str, Any]) -> None:
    """A positive body kept within the content rules the document cannot state."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        body["prompt"] = prompt[:MAX_TEXT]
    elif isinstance(prompt, list):  # token ids, or several prompts
        body["prompt"] = [p[:MAX_TEXT] if isinstance(p, str | list) else p
                          for p in prompt[:MAX_ITEMS]]
    for key in ("messages", "input"):
        if isinstance(body.get(key), list):
            kept = [_message(m) for m in body[key][-MAX_ITEMS:]]
            body[key] = [m for m in kept if m is not None]
            if not body[key]:  # only replayed calls: a user turn instead
                body[key] = "fuzz" if key == "input" else [{"role": "user", "content": "x"}]
        elif isinstance(body.get(key), str):
            body[key] = body[key][:MAX_TEXT]
    if isinstance(body.get("instructions"), str):
        body["instructions"] = body["instructions"][:MAX_TEXT]
    # the tool requests' rules (declared functions, compiling schemas, a template that
    # renders tools) belong to the tool tests
    for key in ("tools", "tool_choice", "parallel_tool_calls"):
        body.pop(key, None)
    budget = next((_integer(body[k]) for k in _BUDGET_FIELDS
                   if _integer(body.get(k)) is not None), 1)
    low = _integer(body.get("min_tokens"))
    if low is not None and budget is not None and low > budget:  # within the budget
        body["min_tokens"] = budget
    if "best_of" in body and body["best_of"] is not None:  # best_of only equal to n
        body["best_of"] = body.get("n", 1)
    _compilable(body)


def _integer(value: Any) -> int | None:
    """An integer as JSON writes it (``5`` or ``5.0``), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return int(value) if float(value).is_integer() else None


def _message(m: Any) -> Any:
    """A message without tool calls (the served template does not render them)."""
    if not isinstance(m, dict):
        return m
    if m.get("type") in ("function_call", "function_call_output", "reasoning"):
        return None
    m.pop("tool_calls", None)
    content = m.get("content")
    if isinstance(content, str):
        m["content"] = content[:MAX_TEXT]
    elif isinstance(content, list):
        m["content"] = content[:MAX_ITEMS]
        for part in m["content"]:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                part["text"] = part["text"][:MAX_TEXT]
    return m


def _compilable(body: dict[str, Any]) -> None:
    """Constraints that compile: a grammar, regex or JSON schema is checked by compiling
    it, which no JSON Schema keyword states."""
    so = body.get("structured_outputs")
    if isinstance(so, dict):
        for key, good in (("regex", "[a-z]{1,3}"), ("grammar", 'start: "yes" | "no"'),
                          ("json", {"type": "object"})):
            if so.get(key) is not None:
                so[key] = good
    rf = body.get("response_format")
    if isinstance(rf, dict) and isinstance(rf.get("json_schema"), dict) and \
            rf["json_schema"].get("schema") is not None:
        rf["json_schema"]["schema"] = {"type": "object"}
    if isinstance(rf, dict) and rf.get("schema") is not None:  # json_object's schema
        rf["schema"] = {"type": "object"}
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"),
                                                                 dict) else None
    if isinstance(fmt, dict) and fmt.get("schema") is not None:
        fmt["schema"] = {"type": "object"}
