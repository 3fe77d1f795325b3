"""The HTTP front's OpenAPI document (``/openapi.json``), exact for this server.

Every operation lists every status the server can send, each with its body: the OpenAI
error object for 4xx and 5xx, ``Retry-After`` on 429 and 503, ``WWW-Authenticate`` on
401 (documented, with a bearer security scheme, only where the server checks a key);
generation routes answer JSON or, when streaming, ``text/event-stream``; ``/metrics`` is
Prometheus text (``text/plain; version=0.0.4``). An undeclared method gets 405 with
``Allow`` (``serving.http_errors``).

Request bodies say what the server accepts, as far as JSON Schema can: ``model`` is the
served name, token ids lie in the vocabulary, ``/tokenize`` takes exactly one of
``prompt``, ``messages``; ``structured_outputs`` exactly one kind, not beside a
``response_format`` that constrains; ``stream_options`` and ``top_logprobs`` only with
``stream`` and ``logprobs``. What depends on content rather than shape is checked by the
server alone and not written here: whether a grammar, regex or JSON schema compiles,
whether the chat template renders the messages (tool calls need one that does), whether
a prompt's tokens fit ``max_model_len``, ``min_tokens`` against the token budget,
``best_of`` equal to ``n``, and a ``tool_choice`` naming a declared function.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from serving.metrics import CONTENT_TYPE as METRICS_TYPE

REF = "#/components/schemas/{model}"
_NULL = {"type": "null"}
_ERROR = {"$ref": REF.format(model="ErrorResponse")}
ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
_REASONS = {
    400: "Bad request: the body, a field or a header is invalid (``param`` names it)",
    401: "Missing or wrong API key", 404: "Unknown model",
    413: "Request body over ``server.max_request_bytes``",
    429: "Admission queue full: retry after ``Retry-After`` seconds",
    500: "Internal error (a bug, or the engine failed this request)",
    503: "Warming up, draining or engine down: retry after ``Retry-After`` seconds"}
_HEADERS = {401: "WWW-Authenticate", 429: "Retry-After", 503: "Retry-After"}

_OBJ = {"type": "object"}
_STATUS = {"type": "object", "required": ["status"],
           "properties": {"status": {"type": "string"}}}


def _completion(kind: str) -> dict[str, Any]:
    return {"type": "object", "required": ["id", "object", "created", "model", "choices",
                                           "usage"],
            "properties": {"object": {"const": kind}, "choices": {"type": "array"}}}


# path -> (200 body schema, streams, error statuses, checks the API key)
GENERATION = (400, 404, 413, 429, 500, 503)
BODY = (400, 404, 413, 500, 503)
OPERATIONS: dict[str, tuple[dict[str, Any] | None, bool, tuple[int, ...], bool]] = {
    "/v1/completions": (_completion("text_completion"), True, GENERATION, True),
    "/v1/chat/completions": (_completion("chat.completion"), True, GENERATION, True),
    "/v1/responses": ({"type": "object", "required": ["id", "object", "status", "output",
                                                      "model"],
                       "properties": {"object": {"const": "response"}}}, True, GENERATION,
                      True),
    "/v1/models": ({"type": "object", "required": ["object", "data"],
                    "properties": {"data": {"type": "array"}}}, False, (500,), True),
    "/tokenize": ({"type": "object", "required": ["count", "tokens"], "properties": {
        "count": {"type": "integer"}, "tokens": {"type": "array", "items": {
            "type": "integer"}}}}, False, BODY, True),
    "/detokenize": ({"type": "object", "required": ["prompt"],
                     "properties": {"prompt": {"type": "string"}}}, False, BODY, True),
    "/tokenizer_info": (_OBJ, False, (400, 500, 503), True),
    "/version": ({"type": "object", "required": ["version"]}, False, (500,), False),
    "/health": (_STATUS, False, (500, 503), False),
    "/health/ready": (_STATUS, False, (500, 503), False),
    "/health/live": (_STATUS, False, (500,), False),
    "/metrics": (None, False, (500,), False),
}


def responses(path: str, auth: bool) -> dict[str, Any]:
    """The ``responses`` object of the operation at ``path``."""
    ok, streams, errors, checks_key = OPERATIONS[path]
    if ok is None:  # Prometheus text
        content: dict[str, Any] = {METRICS_TYPE.split(";")[0] + "; version=0.0.4": {
            "schema": {"type": "string"}}}
    else:
        content = {"application/json": {"schema": ok}}
        if streams:  # the schema of each event
            named = path == "/v1/responses"  # Responses events carry their type
            content["text/event-stream"] = {"schema": {
                "type": "object", "required": ["event", "data"] if named else ["data"],
                "properties": {"event": {"type": "string"}, "data": {"type": "string"}}}}
    out: dict[str, Any] = {"200": {"description": "OK", "content": content}}
    statuses = sorted({*errors, *((401,) if auth and checks_key else ())})
    for status in statuses:
        body = _STATUS if status == 503 and path.startswith("/health") else _ERROR
        reply: dict[str, Any] = {"description": _REASONS[status],
                                 "content": {"application/json": {"schema": body}}}
        if status in _HEADERS:
            reply["headers"] = {_HEADERS[status]: {"required": True,
                                                   "schema": {"type": "string"}}}
        out[str(status)] = reply
    return out


def document(base: dict[str, Any], bodies: Sequence[type[BaseModel]], *, served: str,
             max_n: int, vocab: int | None, auth: bool) -> dict[str, Any]:
    """FastAPI's document ``base`` with the exact responses, the body schemas and the
    bearer scheme (when the server checks a key)."""
    _, top = models_json_schema([(m, "validation") for m in bodies], ref_template=REF)
    schemas = top["$defs"]
    refine(schemas, served=served, max_n=max_n, vocab=vocab)
    schemas["ErrorResponse"] = ERROR_SCHEMA
    base.setdefault("components", {}).setdefault("schemas", {}).update(schemas)
    if auth:
        base["components"]["securitySchemes"] = {"bearer": {"type": "http",
                                                            "scheme": "bearer"}}
    for path, item in base.get("paths", {}).items():
        for op in item.values():
            op["responses"] = responses(path, auth)
            if auth and OPERATIONS[path][3]:
                op["security"] = [{"bearer": []}]
    return base


def refine(schemas: dict[str, Any], *, served: str, max_n: int, vocab: int | None) -> None:
    """What pydantic cannot say about the bodies, said in JSON Schema."""
    token = {"type": "integer", "minimum": 0,
             **({"maximum": vocab - 1} if vocab else {})}
    nonempty = {"type": "string", "minLength": 1}
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas[name]["properties"]
        props["model"] = {"type": "string", "enum": [served]}
        for field in ("n", "best_of"):
            if field in props:
                props[field]["maximum"] = max_n
        props["stop"] = {"anyOf": [{**nonempty, "maxLength": 1024}, {
            "type": "array", "maxItems": 64, "items": {**nonempty, "maxLength": 1024}},
            _NULL]}
        props["stop_token_ids"] = {"anyOf": [{"type": "array", "maxItems": 1024,
                                              "items": token}, _NULL]}
        if vocab:
            props["logit_bias"]["propertyNames"] = {"maxLength": 10,
                                                    "pattern": below(vocab)}
        schemas[name]["allOf"] = [
            _only_with("stream_options", {"type": "object"}, "stream", True),
            {"not": {"required": ["response_format", "structured_outputs"], "properties": {
                "response_format": {"type": "object", "required": ["type"], "properties": {
                    "type": {"enum": ["json_object", "json_schema"]}}},
                "structured_outputs": {"type": "object"}}}}]
    completion = schemas["CompletionRequest"]
    completion["properties"]["prompt"] = {"anyOf": [
        nonempty, {"type": "array", "minItems": 1, "items": token},
        {"type": "array", "minItems": 1, "maxItems": 256, "items": nonempty},
        {"type": "array", "minItems": 1, "maxItems": 256,
         "items": {"type": "array", "minItems": 1, "items": token}}]}
    completion["allOf"].append(_only_with("max_tokens", {"const": 0}, "echo", True))
    schemas["ChatCompletionRequest"]["allOf"].append(
        _only_with("top_logprobs", {"type": "integer"}, "logprobs", True))
    schemas["ChatMessage"]["allOf"] = [
        {"if": {"properties": {"role": {"enum": ["system", "user", "tool"]}}},
         "then": {"required": ["content"],
                  "properties": {"content": {"type": ["string", "array"]}}},
         "else": {"properties": {}}},
        {"if": {"properties": {"role": {"enum": ["system", "user", "tool"]}}},
         "then": {"properties": {"tool_calls": _NULL}}, "else": {"properties": {}}}]
    kinds = [("json", {"type": ["object", "string"]}), ("regex", {"type": "string"}),
             ("choice", {"type": "array"}), ("grammar", {"type": "string"}),
             ("json_object", {"const": True})]
    schemas["StructuredOutputs"]["oneOf"] = [
        {"required": [k], "properties": {k: s}} for k, s in kinds]
    schemas["ResponseFormat"]["allOf"] = [
        _only_with("type", {"const": "json_schema"}, "json_schema", None)]
    tokenize = schemas["TokenizeRequest"]
    tokenize["properties"]["model"] = {"enum": [served, None]}
    tokenize["oneOf"] = [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"},
                                                "messages": _NULL}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"},
                                                  "prompt": _NULL}}]
    detok = schemas["DetokenizeRequest"]
    detok["properties"]["model"] = {"enum": [served, None]}
    detok["properties"]["tokens"] = {"type": "array", "items": token}
    if "ResponsesRequest" in schemas:
        _refine_responses(schemas, served)


def _refine_responses(schemas: dict[str, Any], served: str) -> None:
    props = schemas["ResponsesRequest"]["properties"]
    props["model"] = {"type": "string", "enum": [served]}
    items = props["input"]["anyOf"][1]
    items["minItems"] = 1  # and one that is not reasoning: reasoning alone is no prompt
    items["contains"] = {"not": {"type": "object", "required": ["type"],
                                 "properties": {"type": {"const": "reasoning"}}}}
    schemas["TextFormat"]["allOf"] = [
        _only_with("type", {"const": "json_schema"}, "schema", None)]


def _only_with(field: str, when: dict[str, Any], needs: str,
               value: Any) -> dict[str, Any]:
    """``field`` (matching ``when``) only beside ``needs`` (``value``: its required
    value; None: any non-null value)."""
    need = {"not": _NULL} if value is None else {"const": value}
    return {"if": {"required": [field], "properties": {field: when}},
            "then": {"required": [needs], "properties": {needs: need}},
            "else": {"properties": {}}}


def below(n: int) -> str:
    """A regex of the decimal integers in [0, n) (n >= 1), leading zeros allowed."""
    top = str(n - 1)
    alts = [f"[0-9]{{1,{len(top) - 1}}}"] if len(top) > 1 else []  # fewer digits
    for i, d in enumerate(top):  # as many digits: top's first i, then a smaller one
        low = 1 if i == 0 and len(top) > 1 else 0
        if int(d) > low:
            rest = len(top) - i - 1
            alts.append(f"{top[:i]}[{low}-{int(d) - 1}]" + (f"[0-9]{{{rest}}}" if rest
                                                            else ""))
    alts.append(top)
    return f"^0*({'|'.join(alts)})$"
