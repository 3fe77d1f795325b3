"""``tools``, ``tool_choice`` and ``parallel_tool_calls`` as a client sends them (OpenAI's
JSON, whichever front it came through), checked into one frozen ``ToolRequest``.

Every problem is a ``FieldError`` naming the field as the chat API spells it
(``tools[1].function.name``, ``tool_choice``), before anything reaches the engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from superinfer_jax.request import FieldError

MAX_TOOLS = 128  # OpenAI's limit
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
EMPTY_PARAMETERS: Mapping[str, Any] = {"type": "object", "properties": {}}
ChoiceMode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolSpec:
    """One function: its name, description and arguments' JSON schema (as JSON text, so
    the spec is hashable and the schema's key order, which orders the output, is kept).
    ``field``: where the request defined it (``tools[2].function``, or ``tools[2]`` for
    the Responses API's flat tools), for errors about it."""

    name: str
    description: str | None
    parameters_json: str
    field: str = ""

    @property
    def parameters(self) -> dict[str, Any]:
        return json.loads(self.parameters_json)

    def openai(self) -> dict[str, Any]:
        """The definition as OpenAI writes it (what a chat template gets as ``tools``)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolRequest:
    """What a request asked for: ``mode`` none | auto | required | named (``name``: the
    forced function); ``parallel``: the client's ``parallel_tool_calls`` (None: unset)."""

    tools: tuple[ToolSpec, ...]
    mode: ChoiceMode
    name: str | None = None
    parallel: bool | None = None

    def tool(self, name: str) -> ToolSpec:
        return next(t for t in self.tools if t.name == name)

    def openai_tools(self) -> list[dict[str, Any]]:
        return [t.openai() for t in self.tools]


def parse_tool_request(tools: Sequence[Any] | None, tool_choice: Any = None,
                       parallel_tool_calls: Any = None) -> ToolRequest | None:
    """The checked request, or None when it asks for no tools (no ``tools``, or
    ``tool_choice: "none"``). ``tool_choice`` defaults as OpenAI's: ``auto`` with tools."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise FieldError("parallel_tool_calls", "parallel_tool_calls must be a boolean")
    specs = _tools(tools)
    mode, name = _choice(tool_choice, specs)
    if mode == "none" or not specs:
        return None
    return ToolRequest(specs, mode, name, parallel_tool_calls)


def _tools(tools: Sequence[Any] | None) -> tuple[ToolSpec, ...]:
    if tools is None:
        return ()
    if not isinstance(tools, list | tuple):
        raise FieldError("tools", "tools must be a list of function definitions")
    if len(tools) > MAX_TOOLS:
        raise FieldError("tools", f"tools holds {len(tools)} definitions; at most {MAX_TOOLS}")
    specs: list[ToolSpec] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise FieldError(f"{where}.type", f"{where}: only function tools are supported "
                             '({"type": "function", "function": {...}})')
        fn = tool.get("function")
        if fn is None and "name" in tool:  # the Responses API's flat function tool
            fn, at = tool, where
        elif isinstance(fn, Mapping):
            at = f"{where}.function"
        else:
            raise FieldError(f"{where}.function", f"{where}.function must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise FieldError(f"{at}.name", f"{at}.name must be 1 to 64 letters, digits, "
                             f"'_', '.' or '-', got {name!r}"[:200])
        if any(s.name == name for s in specs):
            raise FieldError(f"{at}.name", f"{at}.name: {name!r} is defined twice")
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise FieldError(f"{at}.description", f"{at}.description must be a string")
        params = fn.get("parameters", EMPTY_PARAMETERS)
        if params is None:
            params = EMPTY_PARAMETERS
        if not isinstance(params, Mapping):
            raise FieldError(f"{at}.parameters", f"{at}.parameters must be a JSON schema "
                             "object")
        specs.append(ToolSpec(name, description, json.dumps(params, ensure_ascii=False), at))
    return tuple(specs)


def _choice(choice: Any, specs: tuple[ToolSpec, ...]) -> tuple[ChoiceMode, str | None]:
    if choice is None:
        return ("auto" if specs else "none"), None
    if choice in ("none", "auto", "required"):
        if choice == "required" and not specs:
            raise FieldError("tool_choice", 'tool_choice "required" needs tools')
        return choice, None
    name = None
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        fn = choice.get("function")
        # the chat API nests the name; the Responses API does not
        name = fn.get("name") if isinstance(fn, Mapping) else choice.get("name")
    if not isinstance(name, str):
        raise FieldError("tool_choice", 'tool_choice must be "none", "auto", "required" or '
                         '{"type": "function", "function": {"name": ...}}')
    if not any(s.name == name for s in specs):
        raise FieldError("tool_choice", f"tool_choice names function {name!r}"[:120] +
                         f", which is not in tools ({[s.name for s in specs]})"[:400])
    return "named", name
