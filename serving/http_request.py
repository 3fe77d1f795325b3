"""What a request passes before a handler uses it: the API key, then the body read and
checked (a size cap, strict UTF-8, a JSON object nested at most ``MAX_JSON_DEPTH`` deep
with no lone surrogate in any string), validated as its pydantic model, its unknown
fields and its ``model``. Every refusal is an ``HTTPError`` naming the problem."""

from __future__ import annotations

import hmac
import json
import logging
import re
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError

from serving.http_errors import HTTPError, validation_error
from serving.openai_schema import unknown_fields
from serving.runtime import Runtime

log = logging.getLogger(__name__)
MAX_JSON_DEPTH = 64  # no OpenAI body nests deeper; deeper is an attack on the parsers
# Unknown field names are logged once each, up to this many (a client picks the names).
_MAX_LOGGED_UNKNOWN = 256
_LIST_INDEX = re.compile(r"\[\d+\]")


class RequestReader:
    """Checks a request's API key and reads its body for the handlers."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self._logged_unknown: set[str] = set()

    def check_auth(self, request: Request) -> None:
        key = self.runtime.config.server.api_key
        if not key:
            return
        auth = request.headers.get("authorization", "")
        if not auth.lower().startswith("bearer "):
            raise HTTPError(401, "missing API key: send 'Authorization: Bearer <key>'",
                            code="invalid_api_key")
        if not hmac.compare_digest(auth[7:].strip().encode(), key.encode()):
            raise HTTPError(401, "invalid API key", code="invalid_api_key")

    async def generation_body(self, request: Request, cls: type) -> Any:
        """A generation route's body: supported fields only, for the served model."""
        parsed = await self._validated_body(request, cls)
        problem = parsed.unsupported()
        if problem:
            field, message = problem
            raise HTTPError(400, message, param=field)
        self._check_model(parsed.model)
        return parsed

    async def tool_body(self, request: Request, cls: type) -> Any:
        """A tokenizer route's body: the API key, the parse, ``model`` if given."""
        parsed = await self._validated_body(request, cls)
        if parsed.model is not None:
            self._check_model(parsed.model)
        return parsed

    async def _validated_body(self, request: Request, cls: type) -> Any:
        """The API key, then the body read and validated as ``cls`` (unknown fields
        logged or refused)."""
        self.check_auth(request)
        body = await read_body(request, self.runtime.config.server.max_request_bytes)
        try:
            parsed = cls.model_validate(body)
        except ValidationError as e:
            raise validation_error(e) from e
        self._check_unknown(parsed)
        return parsed

    def _check_model(self, model: str) -> None:
        if model != self.runtime.served_name:
            raise HTTPError(404, f"model {model!r} does not exist; this server serves "
                                 f"{self.runtime.served_name!r}", param="model",
                            code="model_not_found")

    def _check_unknown(self, parsed: BaseModel) -> None:
        """Unknown fields: a 400 in strict mode, else ignored and logged once per name."""
        unknown = unknown_fields(parsed)
        if not unknown:
            return
        if self.runtime.config.server.strict_request_fields:
            raise HTTPError(400, f"{unknown[0]}: unknown field (server.strict_request_fields "
                                 "is on)", param=unknown[0])
        for path in unknown:
            name = _LIST_INDEX.sub("[]", path)  # messages[].audio: once, whatever the index
            if name in self._logged_unknown or len(self._logged_unknown) > _MAX_LOGGED_UNKNOWN:
                continue
            self._logged_unknown.add(name)
            if len(self._logged_unknown) > _MAX_LOGGED_UNKNOWN:
                log.warning("more unknown request fields: no longer logging new names")
            else:
                log.warning("ignoring unknown request field %r (logged once)", name)


async def read_body(request: Request, limit: int) -> dict[str, Any]:
    """The JSON object of the body, refusing oversize, non-UTF-8 and non-JSON bodies."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise HTTPError(413, f"request body is {length} bytes; the limit is {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPError(413, f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    try:
        text = b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as e:
        raise HTTPError(400, f"request body is not valid UTF-8 (byte {e.start})") from e
    try:
        body = json.loads(text)
    except ValueError as e:  # JSONDecodeError, or an integer literal over 4300 digits
        raise HTTPError(400, f"request body is not valid JSON: {e}") from e
    except RecursionError as e:
        raise HTTPError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels") from e
    if not isinstance(body, dict):
        raise HTTPError(400, "request body must be a JSON object")
    _check_json_values(body)
    return body


def _check_json_values(body: dict[str, Any]) -> None:
    """Refuse what valid JSON can hold but no consumer should get: nesting deeper than
    ``MAX_JSON_DEPTH`` and strings with a lone UTF-16 surrogate (``"\ud800"`` decodes to
    a str that cannot be encoded, which the tokenizer rejects). Iterative, so a deep body
    cannot exhaust the stack here either; numbers are skipped and a value's path (a
    linked trail of keys) is spelled out only for the error, so a long token-id prompt
    costs one type check per id."""
    stack: list[tuple[dict[str, Any] | list[Any], _Trail, int]] = [(body, None, 0)]
    while stack:
        value, trail, depth = stack.pop()
        if depth >= MAX_JSON_DEPTH and value:  # its items sit deeper than allowed
            path = _path((trail, next(iter(value)) if isinstance(value, dict) else 0))
            raise HTTPError(400, f"{path}: nests deeper than {MAX_JSON_DEPTH} levels",
                            param=path)
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str):
                _check_string(key, (trail, key))
            if isinstance(item, str):
                _check_string(item, (trail, key))
            elif isinstance(item, (dict, list)):
                stack.append((item, (trail, key), depth + 1))


# A JSON value's place: (parent's trail, key or list index), None at the top.
_Trail = tuple[Any, str | int] | None


def _path(trail: _Trail) -> str:
    """``messages[0].content`` for the trail of that value ("body" for the top)."""
    parts: list[str | int] = []
    while trail is not None:
        trail, key = trail
        parts.append(key)
    path = ""
    for key in reversed(parts):
        path += f"[{key}]" if isinstance(key, int) else (f".{key}" if path else key)
    return path or "body"


def _check_string(value: str, trail: _Trail) -> None:
    if value.isascii():  # no surrogate possible: the common case, at C speed
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        # the path itself may hold the surrogate (an object key): escape it for the reply
        path = _path(trail).encode("utf-8", "backslashreplace").decode("utf-8")
        raise HTTPError(400, f"{path}: string holds a lone UTF-16 surrogate "
                             f"(\\u{ord(value[e.start]):04x} at character {e.start}); send "
                             "valid Unicode", param=path) from e
