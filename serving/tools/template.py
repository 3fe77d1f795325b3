"""What a chat template can do with tools, asked of the template itself, and the
deployment's own template (``model.chat_template``, ``--chat-template FILE``)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import meta

_PROBE_USER = {"role": "user", "content": "probe"}


def _source(tokenizer: Any) -> str:
    return getattr(tokenizer, "chat_template", None) or ""


@functools.lru_cache(maxsize=8)
def _variables(source: str) -> frozenset[str]:
    try:
        return frozenset(meta.find_undeclared_variables(jinja2.Environment().parse(source)))
    except jinja2.TemplateError:
        return frozenset()


def renders_tools(tokenizer: Any) -> bool:
    """The template reads a ``tools`` variable (the definitions, as transformers passes
    them): it can show the model its functions, which ``tool_choice: auto`` needs."""
    return "tools" in _variables(_source(tokenizer))


def renders_parallel_calls(tokenizer: Any) -> bool:
    """An assistant turn with two tool calls renders both: the template can show the
    model parallel calls (a template that reads only the first drops the others)."""
    source = _source(tokenizer)
    if "tool_calls" not in source:
        return False
    return _renders_both(source, tokenizer)


def _renders_both(source: str, tokenizer: Any) -> bool:
    calls = [{"id": f"call_probe{i}", "type": "function",
              "function": {"name": f"probe_fn_{i}", "arguments": "{}"}} for i in (1, 2)]
    messages = [_PROBE_USER, {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "call_probe1", "content": "1"},
                {"role": "tool", "tool_call_id": "call_probe2", "content": "2"}]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that raises cannot render them
        return False
    return "probe_fn_1" in text and "probe_fn_2" in text


def install_chat_template(tokenizer: Any, path: str) -> None:
    """Replace the tokenizer's chat template with the file at ``path``."""
    text = Path(path).expanduser().read_text(encoding="utf-8")
    tokenizer.chat_template = text
    vars(tokenizer).pop("_compiled_template", None)  # a cached compile of the old one
