"""The JSON schema a forced call is generated under (``tool_choice`` named or
``required``), through the engine's structured outputs.

- named: the function's ``parameters``: the output is the arguments object;
- required: ``{"name": <const>, "arguments": <that function's parameters>}``, one
  ``anyOf`` branch per function, ``name`` first so a stream knows the function before
  its arguments; with ``parallel_tool_calls: true`` a non-empty array of them.

An object schema that lists ``properties`` and says nothing of others gets
``additionalProperties: false``: a function's arguments are the ones it declares (OpenAI's
strict function schemas say so outright), and an undeclared key is never a call anyone
can make. The JSON is compact with ``json.dumps``'s separators (llguidance's ``x-guidance``
options): a call is read by programs, and flexible whitespace would let an untrained
model pad forever. Each function's schema is checked to compile first, so a bad one is a
``FieldError`` naming ``tools[i].function.parameters``.
"""

from __future__ import annotations

import importlib
import json
from typing import Any

from serving.tools.spec import ToolRequest, ToolSpec
from superinfer_jax.request import FieldError

FORMAT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def constraint_schema(req: ToolRequest) -> dict[str, Any] | None:
    """The schema of a forced call, None for ``auto`` (free text, parsed after)."""
    if req.mode == "named":
        assert req.name is not None
        tool = req.tool(req.name)
        _check(tool)
        params = _closed(tool.parameters)
        return {**params, "x-guidance": {**FORMAT, **params.get("x-guidance", {})}}
    if req.mode != "required":
        return None
    defs: dict[str, Any] = {}
    branches = []
    for i, tool in enumerate(req.tools):
        _check(tool)
        params = _closed(tool.parameters)
        if "$ref" in tool.parameters_json:  # refs point into the root: hoist its $defs
            params = _hoisted(params, f"tool{i}", defs)
        branches.append({"type": "object", "properties": {
            "name": {"const": tool.name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False})
    one: dict[str, Any] = branches[0] if len(branches) == 1 else {"anyOf": branches}
    schema: dict[str, Any] = ({"type": "array", "minItems": 1, "items": one}
                              if req.parallel else one)
    schema = {"x-guidance": FORMAT, **schema}
    if defs:
        schema["$defs"] = defs
    return schema


_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_VALUES = ("const", "enum", "default", "examples")  # JSON values, not schemas


def _closed(node: Any) -> Any:
    """``node`` with ``additionalProperties: false`` on every object schema that lists
    ``properties`` and does not mention other keys."""
    if isinstance(node, list):
        return [_closed(v) for v in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _MAPS and isinstance(value, dict):  # name -> schema
            out[key] = {name: _closed(sub) for name, sub in value.items()}
        else:
            out[key] = value if key in _VALUES else _closed(value)
    if isinstance(node.get("properties"), dict) and not (
            {"additionalProperties", "patternProperties", "unevaluatedProperties"} & set(node)):
        out["additionalProperties"] = False
    return out


def _check(tool: ToolSpec) -> None:
    field = f"{tool.field or 'tools[?].function'}.parameters"
    try:
        structured = importlib.import_module("superinfer_jax.structured")
    except ImportError:
        raise FieldError(field, f"{field}: forced tool calls need structured outputs, "
                                "which this build lacks") from None
    problem = structured.json_schema_problem(tool.parameters_json)
    if problem:
        raise FieldError(field, f"{field}: cannot be compiled into a grammar: {problem}")


def _hoisted(params: dict[str, Any], prefix: str, defs: dict[str, Any]) -> dict[str, Any]:
    """``params`` moved under ``$defs/<prefix>`` of the combined schema, its own ``$defs``
    (or ``definitions``) beside it as ``<prefix>.<name>``, every local ``$ref`` rewritten;
    returns the reference that replaces it."""
    params = dict(params)
    for key in ("$defs", "definitions"):
        for name, sub in (params.pop(key, None) or {}).items():
            defs[f"{prefix}.{name}"] = sub
    defs[prefix] = params

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: rewrite(v) for k, v in node.items()}
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                out["$ref"] = _ref(ref, prefix)
            return out
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    for name in [n for n in defs if n == prefix or n.startswith(prefix + ".")]:
        defs[name] = rewrite(defs[name])
    return {"$ref": f"#/$defs/{prefix}"}


def _ref(ref: str, prefix: str) -> str:
    for head in ("#/$defs/", "#/definitions/"):
        if ref.startswith(head):
            name, _, rest = ref[len(head):].partition("/")
            return f"#/$defs/{prefix}.{name}" + (f"/{rest}" if rest else "")
    return f"#/$defs/{prefix}" + ref[1:]  # "#" or "#/properties/..."


def constraint_json(req: ToolRequest) -> str | None:
    schema = constraint_schema(req)
    return None if schema is None else json.dumps(schema, ensure_ascii=False)
