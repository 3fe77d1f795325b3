"""The HTTP front's errors: every failure answered as an OpenAI-shaped error.

``HTTPError`` is what handlers raise; ``install_error_handlers`` answers it, an unknown
route (404, 405) and an unexpected exception (a bug: logged, answered as a 500) in the
same shape. 401 carries ``WWW-Authenticate``; 429 and 503 carry ``Retry-After``; 405
carries ``Allow``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.openai_schema import ChatCompletionRequest, CompletionRequest, error_json
from superinfer_jax.async_engine import EngineUnavailableError, QueueFullError
from superinfer_jax.request import FieldError

log = logging.getLogger(__name__)
RETRY_AFTER_S = {429: "1", 503: "5"}


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_response(e: HTTPError, extra: Mapping[str, str] | None = None) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else {}
    headers.update(extra or {})
    if e.status in RETRY_AFTER_S:
        headers["Retry-After"] = RETRY_AFTER_S[e.status]
    return JSONResponse(error_json(e.status, e.message, e.param, e.code), e.status,
                        headers=headers)


def status_of(e: BaseException) -> int:
    """The status of a request the engine refused: queue full, engine down, or bad."""
    if isinstance(e, QueueFullError):
        return 429
    if isinstance(e, EngineUnavailableError):
        return 503
    return 400


async def _http_error(request: Request, e: Exception) -> JSONResponse:
    return error_response(cast(HTTPError, e))


async def _unexpected(request: Request, e: Exception) -> JSONResponse:
    """A bug: logged with its traceback, answered as a visible 500."""
    log.error("unhandled %s on %s %s", type(e).__name__, request.method,
              request.url.path, exc_info=e)
    return error_response(HTTPError(500, f"internal error: {type(e).__name__}: {e}",
                                    code="internal_error"))


async def _starlette_error(request: Request, e: Exception) -> JSONResponse:
    http = cast(StarletteHTTPException, e)
    message = (f"no route {request.method} {request.url.path}" if http.status_code in
               (404, 405) else str(http.detail))
    # 405 keeps the router's ``Allow`` (RFC 9110: the methods the resource has)
    return error_response(HTTPError(http.status_code, message), http.headers)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(HTTPError, _http_error)
    app.add_exception_handler(Exception, _unexpected)
    app.add_exception_handler(StarletteHTTPException, _starlette_error)


def validation_error(e: ValidationError) -> HTTPError:
    """A pydantic failure as a 400 naming the first bad field (and how many more)."""
    err = e.errors()[0]
    loc = _field_path(err["loc"]) or None
    msg = err["msg"]
    if err["type"] == "missing":
        msg = "field required"
    more = f" (and {len(e.errors()) - 1} more problems)" if len(e.errors()) > 1 else ""
    return HTTPError(400, f"{loc}: {msg}{more}" if loc else msg + more, param=loc)


def _field_path(loc: tuple[Any, ...]) -> str:
    """A pydantic error location as the body spells it: the field names, with list
    indexes in brackets (``messages[0].content``); union-branch tags left out."""
    path = ""
    names = iter(loc)
    for part in names:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in ("str", "int", "float", "bool", "list[int]", "list[str]") or \
                str(part).startswith(("list[", "function-", "literal[")):
            continue
        else:
            path += f".{part}" if path else str(part)
    return path


# The engine's field names (``superinfer_jax.request``) as the HTTP bodies spell them.
_HTTP_FIELD_PREFIXES = (("slo.", "slo_constraints."), ("text", "prompt"),
                        ("token_ids", "prompt"))


def http_param(field: str, body: CompletionRequest | ChatCompletionRequest) -> str:
    """The body field an engine ``FieldError`` is about (so ``param`` always names a
    field the client sent or must send)."""
    chat = isinstance(body, ChatCompletionRequest)
    if field == "max_tokens" and chat and body.max_completion_tokens is not None:
        return "max_completion_tokens"
    if field == "prompt" and chat:
        return "messages"
    if field in ("logprobs", "prompt_logprobs"):
        chat_top = isinstance(body, ChatCompletionRequest) and body.top_logprobs is not None
        return "top_logprobs" if chat_top else "logprobs"
    if field.startswith(("structured_outputs", "structured")):
        try:
            used = body.structured()
        except FieldError:
            used = None
        return field if used is None else used[0]
    for engine_prefix, http_prefix in _HTTP_FIELD_PREFIXES:
        if field.startswith(engine_prefix):
            return http_prefix + field[len(engine_prefix):]
    return field
