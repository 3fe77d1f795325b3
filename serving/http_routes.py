"""The HTTP front's routes: one table (path, method, handler, request body model) and the
small handlers it names; ``build_app`` turns the table into the FastAPI app.

The OpenAPI document (``/openapi.json``, browsable at ``/docs``) carries the request-body
schemas of the routes that take a body, so clients and fuzzers can generate from it.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from serving.http_errors import RETRY_AFTER_S, HTTPError, install_error_handlers
from serving.metrics import CONTENT_TYPE
from serving.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from serving.openapi_doc import REF, document
from serving.requests import render_chat
from serving.responses_api import ResponsesAPI
from serving.responses_schema import ResponsesRequest
from serving.runtime import ServerState
from superinfer_jax.request import FieldError

if TYPE_CHECKING:
    from serving.http_server import OpenAIFront

try:
    _VERSION = importlib.metadata.version("superinfer-jax")
except importlib.metadata.PackageNotFoundError:
    _VERSION = "unknown"


@dataclass(frozen=True)
class Route:
    path: str
    method: str
    handler: Callable[..., Awaitable[Response]]
    body: type[BaseModel] | None = None  # the body's schema in the OpenAPI document


def routes(h: Handlers) -> tuple[Route, ...]:
    return (
        Route("/v1/completions", "POST", h.completions, CompletionRequest),
        Route("/v1/chat/completions", "POST", h.chat_completions, ChatCompletionRequest),
        Route("/v1/responses", "POST", h.responses, ResponsesRequest),
        Route("/v1/models", "GET", h.models),
        Route("/tokenize", "POST", h.tokenize, TokenizeRequest),
        Route("/detokenize", "POST", h.detokenize, DetokenizeRequest),
        Route("/tokenizer_info", "GET", h.tokenizer_info),
        Route("/version", "GET", h.version),
        Route("/health", "GET", h.health),
        Route("/health/ready", "GET", h.health_ready),
        Route("/health/live", "GET", h.health_live),
        Route("/metrics", "GET", h.metrics),
    )


def build_app(front: OpenAIFront) -> FastAPI:
    app = FastAPI(title="superinfer", version="v1", docs_url="/docs", redoc_url=None,
                  openapi_url="/openapi.json")
    install_error_handlers(app)
    table = routes(Handlers(front))
    for route in table:
        extra = None if route.body is None else _body_schema(route.body)
        app.add_api_route(route.path, route.handler, methods=[route.method],
                          openapi_extra=extra)
    bodies = [route.body for route in table if route.body is not None]
    app.openapi = lambda: _openapi(app, bodies, front.runtime)
    return app


class Handlers:
    """The route handlers. Their names and docstrings are the OpenAPI document's
    operation ids, summaries and descriptions."""

    def __init__(self, front: OpenAIFront):
        self.front = front
        self.reader = front.reader
        self.runtime = front.runtime
        self.responses_api = ResponsesAPI(front.reader, front.generate)

    async def completions(self, request: Request) -> Response:
        return await self.front.generate(request, CompletionRequest)

    async def chat_completions(self, request: Request) -> Response:
        return await self.front.generate(request, ChatCompletionRequest)

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API, served by the chat route (``serving.responses_api``);
        stateless: ``previous_response_id`` is refused."""
        return await self.responses_api.create(request)

    async def models(self, request: Request) -> JSONResponse:
        self.reader.check_auth(request)
        rt = self.runtime
        info = rt.model_info
        card = {"id": rt.served_name, "object": "model", "created": rt.created,
                "owned_by": "superinfer",
                "max_model_len": info.max_model_len if info else None}
        return JSONResponse({"object": "list", "data": [card]})

    async def tokenize(self, request: Request) -> JSONResponse:
        """vLLM's: the token ids of a prompt, or of chat messages as the chat endpoint
        renders them."""
        body = await self.reader.tool_body(request, TokenizeRequest)
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
        info = self.runtime.model_info
        texts = self.front.texts()
        return JSONResponse({
            "count": len(ids), "max_model_len": info.max_model_len if info else None,
            "tokens": ids,
            "token_strs": [texts.text(t) for t in ids] if body.return_token_strs else None})

    async def detokenize(self, request: Request) -> JSONResponse:
        """vLLM's: token ids to text, special tokens kept."""
        body = await self.reader.tool_body(request, DetokenizeRequest)
        tok = self._tokenizer()
        vocab = self.runtime.model_info.vocab_size if self.runtime.model_info else None
        for t in body.tokens:
            if t < 0 or (vocab is not None and t >= vocab):
                raise HTTPError(400, f"tokens must be in [0, {vocab}), got {t}",
                                param="tokens")
        try:
            text = tok.decode(body.tokens, skip_special_tokens=False)
        except TypeError:  # a tokenizer without the keyword
            text = tok.decode(body.tokens)
        return JSONResponse({"prompt": text})

    async def tokenizer_info(self, request: Request) -> JSONResponse:
        """vLLM's: the special tokens and chat template, for clients that tokenize
        through the server (lm-eval's remote tokenizer reads it)."""
        self.reader.check_auth(request)
        tok = self._tokenizer()
        info = self.runtime.model_info
        return JSONResponse({
            "tokenizer_class": type(tok).__name__,
            "bos_token": getattr(tok, "bos_token", None),
            "eos_token": getattr(tok, "eos_token", None),
            "pad_token": None,
            "add_bos_token": bool(getattr(tok, "add_bos", False)),
            "chat_template": getattr(tok, "chat_template", None),
            "model_max_length": info.max_model_len if info else None})

    async def version(self) -> JSONResponse:
        return JSONResponse({"version": _VERSION})

    async def health(self) -> JSONResponse:
        """Readiness (kept for existing probes): 200 only while serving."""
        return self._readiness()

    async def health_ready(self) -> JSONResponse:
        """Readiness probe: 200 while serving; 503 (Retry-After) in warm-up and drain."""
        return self._readiness()

    async def health_live(self) -> JSONResponse:
        """Liveness probe: 200 whenever the process answers HTTP, warm-up and drain
        included (a restart would not help a server that is loading or draining)."""
        return JSONResponse({"status": self.runtime.state.name.lower()})

    async def metrics(self) -> Response:
        return Response(self.runtime.metrics.render(), media_type=CONTENT_TYPE)

    def _readiness(self) -> JSONResponse:
        state = self.runtime.state
        ready = state is ServerState.SERVING
        return JSONResponse({"status": state.name.lower()}, 200 if ready else 503,
                            headers=None if ready else {"Retry-After": RETRY_AFTER_S[503]})

    def _tokenizer(self) -> Any:
        """The served model's tokenizer: 503 while warming up, 400 if it has none."""
        if self.runtime.model_info is None:
            raise HTTPError(503, "server is warming up: retry shortly")
        if self.runtime.tokenizer is None:
            raise HTTPError(400, "this model has no tokenizer")
        return self.runtime.tokenizer


def _body_schema(model: type) -> dict[str, Any]:
    """The route's request body in the OpenAPI document: the handlers read raw bodies
    (to control every error), so FastAPI cannot infer it."""
    schema = {"$ref": REF.format(model=model.__name__)}
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": schema}}}}


def _openapi(app: FastAPI, bodies: Sequence[type[BaseModel]], runtime: Any) -> dict[str, Any]:
    """FastAPI's document made exact (``serving.openapi_doc``) for this server: its model
    name, ``n`` limit, vocabulary (once the model is loaded) and API key."""
    if app.openapi_schema is None:
        info = runtime.model_info
        cfg = runtime.config.server
        doc = document(get_openapi(title=app.title, version=app.version, routes=app.routes),
                       bodies, served=runtime.served_name, max_n=cfg.max_n,
                       vocab=info.vocab_size if info else None, auth=bool(cfg.api_key))
        if info is None:  # the vocabulary bounds come with the model
            return doc
        app.openapi_schema = doc
    return app.openapi_schema
