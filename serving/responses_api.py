"""``POST /v1/responses``: OpenAI's Responses API as a translation layer over the chat
route.

A Responses body is checked (its own schema, the API key, ``model``, the fields a
stateless server refuses), translated into the chat-completions body
(``serving.responses_schema.to_chat``) and served by the chat route itself, as if the
client had sent that body (same headers, same disconnect signal). The chat route's
answer is translated back (``serving.responses_output``): a chat completion into a
``response`` object, a chat chunk stream into the Responses event stream. An error the
chat route raises names the field the client sent (``max_output_tokens``, ``input``,
``text.format``, ``tools[i]``), not the chat field it became.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from serving.http_errors import HTTPError
from serving.http_request import RequestReader
from serving.openai_schema import ChatCompletionRequest
from serving.responses_output import EventStream, from_chat, new_id
from serving.responses_schema import ResponsesRequest, chat_param, to_chat
from superinfer_jax.request import FieldError

# The chat route's entry point: (request, body model) -> response.
Generate = Callable[[Request, type], Awaitable[Response]]


class ResponsesAPI:
    def __init__(self, reader: RequestReader, generate: Generate):
        self.reader = reader
        self.generate = generate

    async def create(self, request: Request) -> Response:
        body: ResponsesRequest = await self.reader.tool_body(request, ResponsesRequest)
        problem = body.unsupported()
        if problem is not None:
            raise HTTPError(400, problem[1], param=problem[0])
        try:
            chat = to_chat(body)
        except FieldError as e:
            raise HTTPError(400, str(e), param=e.field) from e
        rid = new_id("resp")
        try:
            answer = await self.generate(_as_chat_request(request, chat),
                                         ChatCompletionRequest)
        except HTTPError as e:
            raise _renamed(e) from e
        if isinstance(answer, StreamingResponse):
            events = EventStream(rid, body, chat["model"])
            return StreamingResponse(_translate(answer.body_iterator, events),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return JSONResponse(from_chat(rid, body, json.loads(bytes(answer.body))))


def _renamed(e: HTTPError) -> HTTPError:
    """The chat route's error, naming the Responses field."""
    param = chat_param(e.param)
    message = e.message
    lead = _LEAD.match(message)  # the field the message starts with, chat's or the engine's
    if param != e.param and lead and chat_param(lead.group()) == param:
        message = f"{param}{message[lead.end():]}"
    return HTTPError(e.status, message, param=param, code=e.code)


_LEAD = re.compile(r"[\w.\[\]]+")


async def _translate(chunks: AsyncIterable[Any], events: EventStream) -> AsyncIterator[str]:
    """The chat SSE body as Responses events; closing this closes the chat stream (which
    aborts the request if it has not finished)."""
    try:
        for event in events.start():
            yield event
        async for raw in chunks:
            text = raw if isinstance(raw, str) else bytes(raw).decode()
            for line in text.splitlines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for event in events.chunk(json.loads(line[6:])):
                    yield event
        for event in events.end():
            yield event
    finally:
        close = getattr(chunks, "aclose", None)
        if close is not None:
            await close()


def _as_chat_request(request: Request, chat: dict[str, Any]) -> Request:
    """A request carrying ``chat`` as its body, with the original's headers (the API key,
    the SLO headers) and the original's disconnect signal."""
    raw = json.dumps(chat, ensure_ascii=False).encode()
    headers = [(k, v) for k, v in request.scope["headers"]
               if k.lower() not in (b"content-length", b"transfer-encoding")]
    headers.append((b"content-length", str(len(raw)).encode()))
    scope = {**request.scope, "headers": headers, "path": "/v1/chat/completions"}
    sent = False

    async def receive() -> Any:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await request.receive()

    return Request(scope, receive)
