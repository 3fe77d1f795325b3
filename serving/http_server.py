"""The OpenAI-compatible HTTP front: completions, chat, models, health, metrics.

Bodies are read and parsed here (size cap, strict UTF-8, JSON nested at most
``MAX_JSON_DEPTH`` deep with no lone surrogate in any string, then the pydantic model),
so every failure is an OpenAI-shaped error naming the problem (``param``), with a 4xx
code: 400 bad request, 401 API key, 404 unknown model or route, 413 too large, 429
admission queue full, 503 warming up, draining or engine down (429 and 503 carry
``Retry-After``). A 500 is a bug: an unexpected exception is logged and answered as an
OpenAI-shaped 500, never hidden behind a 400.

The OpenAPI document (``/openapi.json``, browsable at ``/docs``) carries the request-body
schemas of both generation routes, so clients and fuzzers can generate from it.

A request is admitted by the engine loop *before* the response starts, so a streaming
request that the engine refuses (a prompt over max_model_len, say) still gets a plain 400
rather than a 200 with an error inside the stream. A client that disconnects (streaming
or not) aborts its request. A stream that fails after it started (the engine failed this
request, or the whole engine went down) ends with an ``error`` event and ``[DONE]``,
never with a silent cut.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.metrics import CONTENT_TYPE
from serving.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_json,
    chunk_json,
    completion_json,
    error_json,
    unknown_fields,
    usage_chunk_json,
    usage_counts,
)
from serving.requests import (
    RequestSummary,
    encode_prompt,
    make_sampling,
    merge_slo,
    slo_from_headers,
)
from serving.runtime import Runtime, ServerState
from superinfer_jax.async_engine import EngineUnavailableError, QueueFullError, RequestStream
from superinfer_jax.engine import RequestOutput
from superinfer_jax.request import FieldError

log = logging.getLogger(__name__)
_DISCONNECT_POLL_S = 0.25
MAX_JSON_DEPTH = 64  # no OpenAI body nests deeper; deeper is an attack on the parsers
_RETRY_AFTER_S = {429: "1", 503: "5"}
# Unknown field names are logged once each, up to this many (a client picks the names).
_MAX_LOGGED_UNKNOWN = 256
_LIST_INDEX = re.compile(r"\[\d+\]")


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def _error_response(e: HTTPError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else {}
    if e.status in _RETRY_AFTER_S:
        headers["Retry-After"] = _RETRY_AFTER_S[e.status]
    return JSONResponse(error_json(e.status, e.message, e.param, e.code), e.status,
                        headers=headers)


def _status_of(e: BaseException) -> int:
    if isinstance(e, QueueFullError):
        return 429
    if isinstance(e, EngineUnavailableError):
        return 503
    return 400


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


def _validation_error(e: ValidationError) -> HTTPError:
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


def _http_param(field: str, body: CompletionRequest | ChatCompletionRequest) -> str:
    """The body field an engine ``FieldError`` is about (so ``param`` always names a
    field the client sent or must send)."""
    chat = isinstance(body, ChatCompletionRequest)
    if field == "max_tokens" and chat and body.max_completion_tokens is not None:
        return "max_completion_tokens"
    if field == "prompt" and chat:
        return "messages"
    for engine_prefix, http_prefix in _HTTP_FIELD_PREFIXES:
        if field.startswith(engine_prefix):
            return http_prefix + field[len(engine_prefix):]
    return field


class OpenAIFront:
    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self._logged_unknown: set[str] = set()
        self.app = self._build_app()

    # -- request -> engine -------------------------------------------------------------

    def _check_auth(self, request: Request) -> None:
        key = self.runtime.config.server.api_key
        if not key:
            return
        auth = request.headers.get("authorization", "")
        if not auth.lower().startswith("bearer "):
            raise HTTPError(401, "missing API key: send 'Authorization: Bearer <key>'",
                            code="invalid_api_key")
        if not hmac.compare_digest(auth[7:].strip().encode(), key.encode()):
            raise HTTPError(401, "invalid API key", code="invalid_api_key")

    async def _parse(self, request: Request, cls: type) -> Any:
        self._check_auth(request)
        body = await read_body(request, self.runtime.config.server.max_request_bytes)
        try:
            parsed = cls.model_validate(body)
        except ValidationError as e:
            raise _validation_error(e) from e
        self._check_unknown(parsed)
        problem = parsed.unsupported()
        if problem:
            field, message = problem
            raise HTTPError(400, message, param=field)
        if parsed.model != self.runtime.served_name:
            raise HTTPError(404, f"model {parsed.model!r} does not exist; this server serves "
                                 f"{self.runtime.served_name!r}", param="model",
                            code="model_not_found")
        return parsed

    def _check_unknown(self, parsed: CompletionRequest | ChatCompletionRequest) -> None:
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

    def _token_ids(self, body: CompletionRequest | ChatCompletionRequest) -> list[int]:
        tok = self.runtime.tokenizer
        if isinstance(body, ChatCompletionRequest):
            return encode_prompt(tok, messages=[m.to_template() for m in body.messages])
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise FieldError("prompt", "prompt: only one prompt per request is supported")
            prompt = prompt[0]
        if isinstance(prompt, list):
            return encode_prompt(tok, token_ids=prompt)
        return encode_prompt(tok, text=prompt)

    async def _submit(self, body: CompletionRequest | ChatCompletionRequest,
                      rid: str, header_slo: dict[str, float] | None = None
                      ) -> tuple[RequestStream, int]:
        """The admitted request's stream and its prompt length in tokens. ``header_slo``:
        the SLO fields the request's headers set (the body's fields win)."""
        header_slo = header_slo or {}
        try:
            engine = self.runtime.serving_engine()
            token_ids = self._token_ids(body)
            max_tokens = body.max_tokens
            if isinstance(body, ChatCompletionRequest):
                if body.max_completion_tokens is not None:
                    max_tokens = body.max_completion_tokens
                if max_tokens is None:  # chat's OpenAI default: until the context is full
                    max_tokens = max(1, engine.engine.config.max_model_len - len(token_ids))
            stop = [body.stop] if isinstance(body.stop, str) else body.stop
            sampling = make_sampling(
                max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                top_k=body.top_k, seed=body.seed, stop=tuple(stop or ()),
                stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos)
            c = body.slo_constraints
            slo = merge_slo(self.runtime.default_slo, header_slo, *(
                () if c is None else (c.ttft_ms, c.tbt_ms, c.priority_class)))
            stream = engine.submit(token_ids, sampling, req_id=rid, slo=slo,
                                   loop=asyncio.get_running_loop(),
                                   cache_salt=body.cache_salt)
            await stream.wait_admitted_async()
        except (ValueError, QueueFullError, EngineUnavailableError) as e:
            param = _http_param(e.field, body) if isinstance(e, FieldError) else None
            raise HTTPError(_status_of(e), str(e), param=param) from e
        return stream, len(token_ids)

    # -- responses ---------------------------------------------------------------------

    async def _generate(self, request: Request, cls: type) -> Response:
        body = await self._parse(request, cls)
        try:
            header_slo = slo_from_headers(request.headers.get)
        except FieldError as e:
            raise HTTPError(400, str(e), param=e.field) from e
        chat = cls is ChatCompletionRequest
        rid = ("chatcmpl-" if chat else "cmpl-") + _new_id()
        stream, prompt_tokens = await self._submit(body, rid, header_slo)
        if body.stream:
            opts = body.stream_options
            include_usage = bool(opts and opts.include_usage)
            continuous = bool(opts and opts.continuous_usage_stats)
            usage = (lambda n: usage_counts(prompt_tokens, n)) if continuous else None
            return StreamingResponse(self._sse(stream, rid, chat, include_usage, usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            last = await self._collect(request, stream)
        except EngineUnavailableError as e:  # the engine went down mid-request
            raise HTTPError(503, str(e)) from e
        if last.error is not None:
            raise HTTPError(500, last.error, code="engine_error")
        s = RequestSummary.from_request(last.request)
        make = chat_json if chat else completion_json
        return JSONResponse(make(rid, self.runtime.served_name, s))

    async def _collect(self, request: Request, stream: RequestStream) -> RequestOutput:
        """The final output; aborts the request if the client goes away first."""
        async def last() -> RequestOutput:
            final = None
            async for out in stream:
                final = out
            return final

        task = asyncio.ensure_future(last())
        try:
            while not task.done():
                done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
                if not done and await request.is_disconnected():
                    self._abort(stream.req_id)
                    break
            return await task
        finally:
            if not task.done():
                self._abort(stream.req_id)
                task.cancel()

    async def _sse(self, stream: RequestStream, rid: str, chat: bool, include_usage: bool,
                   running_usage: Callable[[int], dict[str, int]] | None
                   ) -> AsyncIterator[str]:
        """The SSE body. ``running_usage`` (vLLM's ``continuous_usage_stats``) puts the
        usage so far in every chunk; ``include_usage`` adds OpenAI's final usage chunk.
        A failure after the stream started ends it with an ``error`` event."""
        model = self.runtime.served_name
        with_usage = include_usage or running_usage is not None
        finished = False

        def usage(out: RequestOutput | None) -> dict[str, int] | None:
            if running_usage is None:
                return None
            return running_usage(len(out.request.output_token_ids) if out else 0)

        try:
            if chat:
                yield _sse(chunk_json(rid, model, chat, "", first=True,
                                      with_usage_field=with_usage, usage=usage(None)))
            async for out in stream:
                if out.error is not None:
                    finished = True
                    yield _sse(error_json(500, out.error, code="engine_error"))
                    break
                if out.new_text:
                    yield _sse(chunk_json(rid, model, chat, out.new_text,
                                          with_usage_field=with_usage, usage=usage(out)))
                if out.finished:
                    finished = True
                    s = RequestSummary.from_request(out.request)
                    final = chunk_json(rid, model, chat, None if chat else "",
                                       finish_reason=s.finish_reason,
                                       with_usage_field=with_usage, usage=usage(out))
                    if not include_usage:
                        final["superinfer"] = s.to_json()
                    yield _sse(final)
                    if include_usage:
                        yield _sse(usage_chunk_json(rid, model, chat, s))
            yield "data: [DONE]\n\n"
        except EngineUnavailableError as e:  # the whole engine went down mid-stream
            finished = True
            yield _sse(error_json(503, str(e), code="engine_unavailable"))
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away mid-stream
                self._abort(rid)

    def _abort(self, req_id: str) -> None:
        engine = self.runtime.engine
        if engine is not None:
            engine.abort(req_id)

    # -- the app -----------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="superinfer", version="v1", docs_url="/docs", redoc_url=None,
                      openapi_url="/openapi.json")
        rt = self.runtime

        @app.exception_handler(HTTPError)
        async def _http_error(request: Request, e: HTTPError) -> JSONResponse:
            return _error_response(e)

        @app.exception_handler(Exception)
        async def _unexpected(request: Request, e: Exception) -> JSONResponse:
            """A bug: logged with its traceback, answered as a visible 500."""
            log.error("unhandled %s on %s %s", type(e).__name__, request.method,
                      request.url.path, exc_info=e)
            return _error_response(HTTPError(500, f"internal error: {type(e).__name__}: {e}",
                                             code="internal_error"))

        @app.exception_handler(StarletteHTTPException)
        async def _starlette_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
            message = (f"no route {request.method} {request.url.path}" if e.status_code in
                       (404, 405) else str(e.detail))
            return _error_response(HTTPError(e.status_code, message))

        @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
        async def completions(request: Request) -> Response:
            return await self._generate(request, CompletionRequest)

        @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
        async def chat_completions(request: Request) -> Response:
            return await self._generate(request, ChatCompletionRequest)

        @app.get("/v1/models")
        async def models(request: Request) -> JSONResponse:
            self._check_auth(request)
            info = rt.model_info
            card = {"id": rt.served_name, "object": "model", "created": rt.created,
                    "owned_by": "superinfer",
                    "max_model_len": info.max_model_len if info else None}
            return JSONResponse({"object": "list", "data": [card]})

        def readiness() -> JSONResponse:
            state = rt.state
            ready = state is ServerState.SERVING
            return JSONResponse({"status": state.name.lower()}, 200 if ready else 503,
                                headers=None if ready else {"Retry-After": _RETRY_AFTER_S[503]})

        @app.get("/health")
        async def health() -> JSONResponse:
            """Readiness (kept for existing probes): 200 only while serving."""
            return readiness()

        @app.get("/health/ready")
        async def health_ready() -> JSONResponse:
            """Readiness probe: 200 while serving; 503 (Retry-After) in warm-up and drain."""
            return readiness()

        @app.get("/health/live")
        async def health_live() -> JSONResponse:
            """Liveness probe: 200 whenever the process answers HTTP, warm-up and drain
            included (a restart would not help a server that is loading or draining)."""
            return JSONResponse({"status": rt.state.name.lower()})

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(rt.metrics.render(), media_type=CONTENT_TYPE)

        app.openapi = lambda: _openapi(app)
        return app


_BODY_MODELS = (CompletionRequest, ChatCompletionRequest)
_REF = "#/components/schemas/{model}"


def _body_schema(model: type) -> dict[str, Any]:
    """The route's request body in the OpenAPI document: the handlers read raw bodies
    (to control every error), so FastAPI cannot infer it."""
    schema = {"$ref": _REF.format(model=model.__name__)}
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": schema}}}}


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document plus the body models' schemas under components.schemas."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        _, top = models_json_schema([(m, "validation") for m in _BODY_MODELS],
                                    ref_template=_REF)
        doc.setdefault("components", {}).setdefault("schemas", {}).update(top["$defs"])
        app.openapi_schema = doc
    return app.openapi_schema


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _new_id() -> str:
    return uuid.uuid4().hex


class HttpFront:
    """uvicorn on its own thread and event loop, next to the gRPC server."""

    def __init__(self, runtime: Runtime):
        cfg = runtime.config.server
        self.address = f"{cfg.host}:{cfg.http_port}"
        self.scheme = "https" if cfg.tls_cert else "http"
        config = uvicorn.Config(
            OpenAIFront(runtime).app, host=cfg.host, port=cfg.http_port, lifespan="off",
            log_level="warning", access_log=False, ssl_certfile=cfg.tls_cert,
            ssl_keyfile=cfg.tls_key, timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="http", daemon=True)

    def start(self, timeout_s: float = 30.0) -> HttpFront:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive():
                raise OSError(f"HTTP: cannot bind {self.address} (port in use?)")
            if time.monotonic() > deadline:
                raise OSError(f"HTTP: server did not start on {self.address} in time")
            time.sleep(0.02)
        log.info("HTTP (OpenAI-compatible) listening on %s://%s", self.scheme, self.address)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
