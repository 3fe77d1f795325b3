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
import dataclasses
import hmac
import importlib.metadata
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.logprobs import CompletionLogprobs, TokenTexts, chat_logprobs
from serving.metrics import CONTENT_TYPE
from serving.openai_schema import (
    MAX_PROMPTS,
    ChatCompletionRequest,
    ChoiceResult,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    chat_json,
    chunk_json,
    completion_json,
    error_json,
    unknown_fields,
    usage_chunk_json,
    usage_counts,
    usage_json,
)
from serving.requests import (
    RequestSummary,
    choice_seed,
    encode_prompt,
    make_sampling,
    merge_slo,
    render_chat,
    slo_from_headers,
    structured_spec,
)
from serving.runtime import Runtime, ServerState
from superinfer_jax.async_engine import EngineUnavailableError, QueueFullError, RequestStream
from superinfer_jax.engine import RequestOutput
from superinfer_jax.request import FIELD_RANGES, FieldError
from superinfer_jax.request import Request as EngineRequest

log = logging.getLogger(__name__)
try:
    _VERSION = importlib.metadata.version("superinfer-jax")
except importlib.metadata.PackageNotFoundError:
    _VERSION = "unknown"
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


class OpenAIFront:
    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self._logged_unknown: set[str] = set()
        self._token_texts: TokenTexts | None = None
        self._token_texts_of: Any = None
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
        parsed = await self._validated_body(request, cls)
        problem = parsed.unsupported()
        if problem:
            field, message = problem
            raise HTTPError(400, message, param=field)
        self._check_model(parsed.model)
        return parsed

    async def _parse_tool(self, request: Request, cls: type) -> Any:
        """A tokenizer route's body: the API key, the parse, ``model`` if given."""
        parsed = await self._validated_body(request, cls)
        if parsed.model is not None:
            self._check_model(parsed.model)
        return parsed

    async def _validated_body(self, request: Request, cls: type) -> Any:
        """The API key, then the body read and validated as ``cls`` (unknown fields
        logged or refused)."""
        self._check_auth(request)
        body = await read_body(request, self.runtime.config.server.max_request_bytes)
        try:
            parsed = cls.model_validate(body)
        except ValidationError as e:
            raise _validation_error(e) from e
        self._check_unknown(parsed)
        return parsed

    def _check_model(self, model: str) -> None:
        if model != self.runtime.served_name:
            raise HTTPError(404, f"model {model!r} does not exist; this server serves "
                                 f"{self.runtime.served_name!r}", param="model",
                            code="model_not_found")

    def _tokenizer(self) -> Any:
        """The served model's tokenizer: 503 while warming up, 400 if it has none."""
        if self.runtime.model_info is None:
            raise HTTPError(503, "server is warming up: retry shortly")
        if self.runtime.tokenizer is None:
            raise HTTPError(400, "this model has no tokenizer")
        return self.runtime.tokenizer

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

    def _prompts(self, body: CompletionRequest | ChatCompletionRequest
                 ) -> list[tuple[list[int], str | None]]:
        """Each prompt's token ids, and its text when the client sent text."""
        tok = self.runtime.tokenizer
        if isinstance(body, ChatCompletionRequest):
            return [(encode_prompt(tok, messages=[m.to_template() for m in body.messages]),
                     None)]
        prompt = body.prompt
        if isinstance(prompt, str):
            return [(encode_prompt(tok, text=prompt), prompt)]
        if not prompt or not isinstance(prompt[0], str | list):  # one token-id list
            return [(encode_prompt(tok, token_ids=prompt), None)]
        if len(prompt) > MAX_PROMPTS:
            raise FieldError("prompt", f"prompt holds {len(prompt)} prompts; at most "
                                       f"{MAX_PROMPTS} per request")
        return [(encode_prompt(tok, text=p), p) if isinstance(p, str)
                else (encode_prompt(tok, token_ids=p), None) for p in prompt]

    def _sampling(self, body: CompletionRequest | ChatCompletionRequest, prompt_len: int,
                  max_model_len: int) -> tuple[dict[str, Any], bool]:
        """The sampling fields every choice shares (the seed is per choice), and whether
        this is prompt scoring only (completions, ``echo`` with ``max_tokens: 0``: one
        token is sampled, as the step always does, and not returned)."""
        max_tokens = body.max_tokens
        score_only = False
        if isinstance(body, ChatCompletionRequest):
            if body.max_completion_tokens is not None:
                max_tokens = body.max_completion_tokens
            if max_tokens is None:  # chat's OpenAI default: until the context is full
                max_tokens = max(1, max_model_len - prompt_len)
            if body.top_logprobs is not None:
                FIELD_RANGES["logprobs"].check("top_logprobs", body.top_logprobs)
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
            prompt_logprobs = None
        else:
            if max_tokens == 0 and body.echo:
                score_only, max_tokens = True, 1
            logprobs = body.logprobs
            prompt_logprobs = body.logprobs if body.echo else None
        stop = [body.stop] if isinstance(body.stop, str) else body.stop
        structured = body.structured()
        return {
            "max_tokens": max_tokens, "temperature": body.temperature, "top_p": body.top_p,
            "top_k": body.top_k, "stop": tuple(stop or ()),
            "stop_token_ids": tuple(body.stop_token_ids or ()), "ignore_eos": body.ignore_eos,
            "logprobs": logprobs, "prompt_logprobs": prompt_logprobs,
            "presence_penalty": body.presence_penalty,
            "frequency_penalty": body.frequency_penalty,
            "repetition_penalty": body.repetition_penalty, "min_tokens": body.min_tokens,
            "logit_bias": body.logit_bias_pairs() or None,
            "structured": None if structured is None else structured_spec(
                structured[1], structured[2], structured[0]),
        }, score_only

    async def _submit(self, body: CompletionRequest | ChatCompletionRequest,
                      rid: str, header_slo: dict[str, float] | None = None
                      ) -> list[_Choice]:
        """Every choice, admitted: ``n`` per prompt, choice ``index`` = prompt * n + j (as
        OpenAI numbers them). A prompt's first choice is submitted as is and the other
        n-1 as its forks (they share its prompt pages); choice j's seed is seed + j.
        ``header_slo``: the SLO fields the request's headers set (the body's win)."""
        header_slo = header_slo or {}
        choices: list[_Choice] = []
        engine = None
        try:
            engine = self.runtime.serving_engine()
            max_n = self.runtime.config.server.max_n
            if not 1 <= body.n <= max_n:
                raise FieldError("n", f"n must be in [1, {max_n}], got {body.n}")
            prompts = self._prompts(body)
            c = body.slo_constraints
            slo = merge_slo(self.runtime.default_slo, header_slo, *(
                () if c is None else (c.ttft_ms, c.tbt_ms, c.priority_class)))
            echo = isinstance(body, CompletionRequest) and body.echo
            total = len(prompts) * body.n
            loop = asyncio.get_running_loop()
            for p, (token_ids, text) in enumerate(prompts):
                fields, score_only = self._sampling(body, len(token_ids),
                                                    engine.engine.config.max_model_len)
                first: str | None = None
                for j in range(body.n):
                    index = p * body.n + j
                    sampling = make_sampling(**fields, seed=choice_seed(body.seed, j))
                    req_id = rid if total == 1 else f"{rid}-{index}"
                    stream = engine.submit(token_ids, sampling, req_id=req_id, slo=slo,
                                           loop=loop, cache_salt=body.cache_salt,
                                           fork_of=first)
                    first = first or req_id
                    prompt_text = None
                    if echo:
                        prompt_text = text if text is not None else self._decode(token_ids)
                    choices.append(_Choice(index, stream, token_ids, prompt_text,
                                           sampling.logprobs, score_only, j == 0))
            for choice in choices:
                await choice.stream.wait_admitted_async()
        except (ValueError, QueueFullError, EngineUnavailableError) as e:
            for choice in choices:
                self._abort(choice.stream.req_id)
            param = _http_param(e.field, body) if isinstance(e, FieldError) else None
            raise HTTPError(_status_of(e), str(e), param=param) from e
        except BaseException:  # a bug (a 500) or a cancelled request: no choice left behind
            for choice in choices:
                self._abort(choice.stream.req_id)
            raise
        return choices

    def _decode(self, token_ids: list[int]) -> str:
        """An echoed token-id prompt's text: special tokens kept (as its logprobs'
        tokens are, so ``text_offset`` points into this text)."""
        tok = self.runtime.tokenizer
        if tok is None:
            return ""
        try:
            return str(tok.decode(token_ids, skip_special_tokens=False))
        except TypeError:  # a tokenizer without the keyword
            return str(tok.decode(token_ids))

    # -- responses ---------------------------------------------------------------------

    async def _generate(self, request: Request, cls: type) -> Response:
        body = await self._parse(request, cls)
        try:
            header_slo = slo_from_headers(request.headers.get)
        except FieldError as e:
            raise HTTPError(400, str(e), param=e.field) from e
        chat = cls is ChatCompletionRequest
        rid = ("chatcmpl-" if chat else "cmpl-") + _new_id()
        choices = await self._submit(body, rid, header_slo)
        texts = self._texts()
        if body.stream:
            opts = body.stream_options
            include_usage = bool(opts and opts.include_usage)
            continuous = bool(opts and opts.continuous_usage_stats)
            return StreamingResponse(
                self._sse(choices, rid, chat, include_usage, continuous, texts),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            finals = await self._collect(request, choices)
        except EngineUnavailableError as e:  # the engine went down mid-request
            raise HTTPError(503, str(e)) from e
        for out in finals:
            if out.error is not None:
                for c in choices:
                    self._abort(c.stream.req_id)
                raise HTTPError(500, out.error, code="engine_error")
        results = [_result(c, out.request, chat, texts)
                   for c, out in zip(choices, finals, strict=True)]
        make = chat_json if chat else completion_json
        return JSONResponse(make(rid, self.runtime.served_name, results,
                                 _usage(choices, [r.summary for r in results])))

    def _texts(self) -> TokenTexts:
        tok = self.runtime.tokenizer
        if self._token_texts is None or self._token_texts_of is not tok:
            self._token_texts, self._token_texts_of = TokenTexts(tok), tok
        return self._token_texts

    async def _collect(self, request: Request, choices: list[_Choice]) -> list[RequestOutput]:
        """Every choice's final output; aborts them all if the client goes away first."""
        async def last() -> list[RequestOutput]:
            final: dict[int, RequestOutput] = {}
            async for c, out in _merge(choices):
                final[c.index] = out
            return [final[c.index] for c in choices]

        task = asyncio.ensure_future(last())
        try:
            while not task.done():
                done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
                if not done and await request.is_disconnected():
                    for c in choices:
                        self._abort(c.stream.req_id)
                    break
            return await task
        finally:
            if not task.done():
                for c in choices:
                    self._abort(c.stream.req_id)
                task.cancel()

    async def _sse(self, choices: list[_Choice], rid: str, chat: bool, include_usage: bool,
                   continuous: bool, texts: TokenTexts) -> AsyncIterator[str]:
        """The SSE body: the choices' chunks interleaved as their tokens come, each naming
        its ``index``. ``continuous`` (vLLM's ``continuous_usage_stats``) puts the
        choice's usage so far in every chunk; ``include_usage`` adds OpenAI's final usage
        chunk (every choice). A failure after the stream started ends it with an
        ``error`` event (and aborts the other choices)."""
        model = self.runtime.served_name
        with_usage = include_usage or continuous
        done: set[int] = set()
        summaries: dict[int, RequestSummary] = {}

        def usage(c: _Choice, out: RequestOutput | None) -> dict[str, int] | None:
            if not continuous:
                return None
            n = 0 if out is None or c.score_only else len(out.request.output_token_ids)
            return usage_counts(len(c.prompt_ids), n)

        def chunk(c: _Choice, text: str | None, out: RequestOutput | None,
                  **kw: Any) -> dict[str, Any]:
            return chunk_json(rid, model, chat, text, with_usage_field=with_usage,
                              usage=usage(c, out), index=c.index, **kw)

        merged = _merge(choices)
        try:
            if chat:
                for c in choices:
                    yield _sse(chunk(c, "", None, first=True))
            async for c, out in merged:
                if out.error is not None:
                    done.update(x.index for x in choices)
                    for other in choices:
                        self._abort(other.stream.req_id)
                    yield _sse(error_json(500, out.error, code="engine_error"))
                    break
                if c.prompt_text is not None and not c.echoed:  # echo: the prompt first
                    c.echoed = True
                    lp = None if c.logprobs is None else c.completion_lp(texts).part(
                        c.prompt_ids, out.prompt_logprobs or [])
                    yield _sse(chunk(c, c.prompt_text, out, logprobs=lp))
                new_tokens = out.new_token_ids and c.logprobs is not None
                if not c.score_only and (out.new_text or new_tokens):
                    lp = None
                    if c.logprobs is not None:
                        entries = out.logprobs or []
                        lp = (chat_logprobs(entries, texts) if chat else
                              c.completion_lp(texts).part(out.new_token_ids, entries))
                    yield _sse(chunk(c, out.new_text, out, logprobs=lp))
                if out.finished:
                    done.add(c.index)
                    s = RequestSummary.from_request(out.request)
                    summaries[c.index] = s
                    final = chunk(c, None if chat else "", out,
                                  finish_reason="length" if c.score_only else s.finish_reason)
                    if not include_usage:
                        final["superinfer"] = s.to_json()
                    yield _sse(final)
            else:
                if include_usage:
                    ordered = [summaries[c.index] for c in choices]
                    yield _sse(usage_chunk_json(rid, model, chat, _usage(choices, ordered),
                                                ordered[0]))
            yield "data: [DONE]\n\n"
        except EngineUnavailableError as e:  # the whole engine went down mid-stream
            done.update(x.index for x in choices)
            yield _sse(error_json(503, str(e), code="engine_unavailable"))
            yield "data: [DONE]\n\n"
        finally:
            await merged.aclose()
            for c in choices:
                if c.index not in done:  # the client went away mid-stream
                    self._abort(c.stream.req_id)

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

        @app.post("/tokenize", openapi_extra=_body_schema(TokenizeRequest))
        async def tokenize(request: Request) -> JSONResponse:
            """vLLM's: the token ids of a prompt, or of chat messages as the chat endpoint
            renders them."""
            body = await self._parse_tool(request, TokenizeRequest)
            tok = self._tokenizer()
            if (body.prompt is None) == (body.messages is None):
                raise HTTPError(400, "give exactly one of prompt, messages", param="prompt")
            try:
                if body.messages is not None:
                    text = render_chat(tok, [m.to_template() for m in body.messages],
                                       body.add_generation_prompt)
                else:
                    text = body.prompt
            except FieldError as e:
                raise HTTPError(400, str(e), param=e.field) from e
            special = body.add_special_tokens
            if special is None:
                special = body.messages is None
            ids = [int(t) for t in tok.encode(text)] if text else []
            bos = getattr(tok, "bos_token_id", None)
            if not special and getattr(tok, "add_bos", False) and ids and ids[0] == bos \
                    and not text.startswith(getattr(tok, "bos_token", None) or "\0"):
                ids = ids[1:]  # the BOS the tokenizer added
            info = rt.model_info
            texts = self._texts()
            return JSONResponse({
                "count": len(ids), "max_model_len": info.max_model_len if info else None,
                "tokens": ids,
                "token_strs": [texts.text(t) for t in ids] if body.return_token_strs else None})

        @app.post("/detokenize", openapi_extra=_body_schema(DetokenizeRequest))
        async def detokenize(request: Request) -> JSONResponse:
            """vLLM's: token ids to text, special tokens kept."""
            body = await self._parse_tool(request, DetokenizeRequest)
            tok = self._tokenizer()
            vocab = rt.model_info.vocab_size if rt.model_info else None
            for t in body.tokens:
                if t < 0 or (vocab is not None and t >= vocab):
                    raise HTTPError(400, f"tokens must be in [0, {vocab}), got {t}",
                                    param="tokens")
            try:
                text = tok.decode(body.tokens, skip_special_tokens=False)
            except TypeError:  # a tokenizer without the keyword
                text = tok.decode(body.tokens)
            return JSONResponse({"prompt": text})

        @app.get("/tokenizer_info")
        async def tokenizer_info(request: Request) -> JSONResponse:
            """vLLM's: the special tokens and chat template, for clients that tokenize
            through the server (lm-eval's remote tokenizer reads it)."""
            self._check_auth(request)
            tok = self._tokenizer()
            info = rt.model_info
            return JSONResponse({
                "tokenizer_class": type(tok).__name__,
                "bos_token": getattr(tok, "bos_token", None),
                "eos_token": getattr(tok, "eos_token", None),
                "pad_token": None,
                "add_bos_token": bool(getattr(tok, "add_bos", False)),
                "chat_template": getattr(tok, "chat_template", None),
                "model_max_length": info.max_model_len if info else None})

        @app.get("/version")
        async def version() -> JSONResponse:
            return JSONResponse({"version": _VERSION})

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

        app.openapi = lambda: _openapi(app, rt.config.server.max_n)
        return app


@dataclass
class _Choice:
    """One choice of a response: its engine request's stream and what shapes its output."""

    index: int
    stream: RequestStream
    prompt_ids: list[int]
    prompt_text: str | None  # echo (completions): the prompt text, sent before the output
    logprobs: int | None  # top alternatives per token asked for; None: no logprobs
    score_only: bool  # echo with max_tokens 0: the one sampled token is not returned
    first_of_prompt: bool  # counts the prompt's tokens in the usage (once per prompt)
    echoed: bool = False
    _lp: CompletionLogprobs | None = None

    def completion_lp(self, texts: TokenTexts) -> CompletionLogprobs:
        """The choice's legacy-logprobs builder (``text_offset`` runs on over chunks)."""
        if self._lp is None:
            self._lp = CompletionLogprobs(texts)
        return self._lp


async def _merge(choices: list[_Choice]
                 ) -> AsyncGenerator[tuple[_Choice, RequestOutput], None]:
    """Every choice's outputs, in the order they come, until each has finished; a stream
    that raises (the engine went down) raises here."""
    queue: asyncio.Queue[tuple[_Choice, RequestOutput | BaseException]] = asyncio.Queue()

    async def pump(c: _Choice) -> None:
        try:
            async for out in c.stream:
                queue.put_nowait((c, out))
        except Exception as e:
            queue.put_nowait((c, e))

    tasks = [asyncio.ensure_future(pump(c)) for c in choices]
    try:
        left = len(choices)
        while left:
            c, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            yield c, item
            if item.finished:
                left -= 1
    finally:
        for task in tasks:
            task.cancel()


def _result(c: _Choice, req: EngineRequest, chat: bool, texts: TokenTexts) -> ChoiceResult:
    """A finished choice in the response's terms (the echo and the logprobs included)."""
    s = RequestSummary.from_request(req)
    output_ids = [] if c.score_only else list(req.output_token_ids)
    text = "" if c.score_only else s.text
    logprobs = None
    if c.logprobs is not None:
        out_lps = req.output_logprobs[:len(output_ids)]
        if chat:
            logprobs = chat_logprobs(out_lps, texts)
        else:
            lp = CompletionLogprobs(texts)
            parts = [lp.part(c.prompt_ids, req.prompt_logprobs)] if c.prompt_text is not None \
                else []
            parts.append(lp.part(output_ids, out_lps))
            logprobs = {k: [v for part in parts for v in part[k]] for k in parts[0]}
    if c.prompt_text is not None:
        text = c.prompt_text + text
    if c.score_only:
        s = dataclasses.replace(s, completion_tokens=0)
    return ChoiceResult(c.index, text, "length" if c.score_only else s.finish_reason,
                        logprobs, s)


def _usage(choices: list[_Choice], summaries: list[RequestSummary]) -> dict[str, Any]:
    """The usage of every choice: each prompt's tokens once, every choice's output."""
    prompt = cached = completion = 0
    for c, s in zip(choices, summaries, strict=True):
        if c.first_of_prompt:
            prompt += s.prompt_tokens
            cached += s.cached_prompt_tokens
        completion += 0 if c.score_only else s.completion_tokens
    return usage_json(prompt, completion, cached)


_BODY_MODELS = (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)
_REF = "#/components/schemas/{model}"


def _body_schema(model: type) -> dict[str, Any]:
    """The route's request body in the OpenAPI document: the handlers read raw bodies
    (to control every error), so FastAPI cannot infer it."""
    schema = {"$ref": _REF.format(model=model.__name__)}
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": schema}}}}


def _openapi(app: FastAPI, max_n: int) -> dict[str, Any]:
    """FastAPI's document plus the body models' schemas under components.schemas, with
    this server's ``n`` limit (``server.max_n``)."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        _, top = models_json_schema([(m, "validation") for m in _BODY_MODELS],
                                    ref_template=_REF)
        for model in (CompletionRequest, ChatCompletionRequest):
            props = top["$defs"][model.__name__]["properties"]
            for name in ("n", "best_of"):
                if name in props:
                    props[name]["maximum"] = max_n
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
