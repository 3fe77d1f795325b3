"""The OpenAI-compatible HTTP front: completions, chat, models, health, metrics.

``OpenAIFront`` turns a generation request into engine requests and their outputs into
the response; the routes (``serving.http_routes``), the request checks
(``serving.http_request``) and the errors (``serving.http_errors``) live beside it.
Every failure is an OpenAI-shaped error naming the problem (``param``), with a 4xx code:
400 bad request, 401 API key, 404 unknown model or route, 413 too large, 429 admission
queue full, 503 warming up, draining or engine down (429 and 503 carry ``Retry-After``).
A 500 is a bug: an unexpected exception is logged and answered as an OpenAI-shaped 500,
never hidden behind a 400.

A request is admitted by the engine loop *before* the response starts, so a streaming
request that the engine refuses (a prompt over max_model_len, say) still gets a plain 400
rather than a 200 with an error inside the stream. A client that disconnects (streaming
or not) aborts its request. A stream that fails after it started (the engine failed this
request, or the whole engine went down) ends with an ``error`` event and ``[DONE]``,
never with a silent cut.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from serving.http_choices import Choice, merge, result, sse, usage
from serving.http_errors import HTTPError, http_param, status_of
from serving.http_request import RequestReader
from serving.http_routes import build_app
from serving.logprobs import TokenTexts, chat_logprobs
from serving.openai_schema import (
    MAX_PROMPTS,
    ChatCompletionRequest,
    CompletionRequest,
    chat_json,
    chunk_json,
    completion_json,
    error_json,
    usage_chunk_json,
    usage_counts,
)
from serving.requests import (
    RequestSummary,
    choice_seed,
    encode_prompt,
    make_sampling,
    merge_slo,
    slo_from_headers,
    structured_spec,
)
from serving.runtime import Runtime
from serving.tools import OutputPlan, finish_reason, plan_output
from superinfer_jax.async_engine import EngineUnavailableError, QueueFullError
from superinfer_jax.engine import RequestOutput
from superinfer_jax.request import FIELD_RANGES, FieldError

log = logging.getLogger(__name__)
_DISCONNECT_POLL_S = 0.25


class OpenAIFront:
    """The generation routes' work: prompts and sampling fields from the body, every
    choice submitted and admitted, then the response (JSON, or SSE as tokens come)."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.reader = RequestReader(runtime)
        self._token_texts: TokenTexts | None = None
        self._token_texts_of: Any = None
        self.app = build_app(self)

    def _plan(self, body: CompletionRequest | ChatCompletionRequest) -> OutputPlan | None:
        """Chat: the tools shown to the template, the forced call's constraint, and how the
        output is read (``serving.tools``); None for completions."""
        if not isinstance(body, ChatCompletionRequest):
            return None
        cfg = self.runtime.config.server
        plan = plan_output(*body.tool_fields(), tokenizer=self.runtime.tokenizer,
                           tool_call_parser=cfg.tool_call_parser,
                           reasoning_parser=cfg.reasoning_parser)
        if plan.constraint is not None and body.structured() is not None:
            raise FieldError("tool_choice", "tool_choice: a forced tool call is generated "
                             "under its function's schema; drop response_format or "
                             "structured_outputs, or send tool_choice \"auto\"")
        return plan

    def _prompts(self, body: CompletionRequest | ChatCompletionRequest,
                 plan: OutputPlan | None = None) -> list[tuple[list[int], str | None]]:
        """Each prompt's token ids, and its text when the client sent text."""
        tok = self.runtime.tokenizer
        if isinstance(body, ChatCompletionRequest):
            tools = None if plan is None else plan.template_tools
            return [(encode_prompt(tok, messages=[m.to_template() for m in body.messages],
                                   tools=tools), None)]
        prompt = body.prompt
        if isinstance(prompt, str):
            return [(encode_prompt(tok, text=prompt), prompt)]
        if not prompt or not isinstance(prompt[0], str | list):  # one token-id list
            return [(self._token_ids(prompt), None)]
        if len(prompt) > MAX_PROMPTS:
            raise FieldError("prompt", f"prompt holds {len(prompt)} prompts; at most "
                                       f"{MAX_PROMPTS} per request")
        return [(encode_prompt(tok, text=p), p) if isinstance(p, str)
                else (self._token_ids(p), None) for p in prompt]

    def _token_ids(self, prompt: Any) -> list[int]:
        """A token-id prompt, checked against the vocabulary before anything (an echo's
        detokenization included) reads it."""
        ids = encode_prompt(self.runtime.tokenizer, token_ids=prompt)
        info = self.runtime.model_info
        vocab = info.vocab_size if info is not None else None
        bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            bound = f"[0, {vocab})" if vocab is not None else ">= 0"
            raise FieldError("prompt", f"prompt token ids must be in {bound}, got {bad[0]}")
        return ids

    def _sampling(self, body: CompletionRequest | ChatCompletionRequest, prompt_len: int,
                  max_model_len: int, plan: OutputPlan | None = None
                  ) -> tuple[dict[str, Any], bool]:
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
        if plan is not None and plan.constraint is not None:
            structured = ("tool_choice", "json", plan.constraint)
        return {
            "max_tokens": max_tokens, "temperature": body.temperature, "top_p": body.top_p,
            "top_k": body.top_k, "stop": tuple(stop or ()),
            "stop_token_ids": tuple(body.stop_token_ids or ()), "ignore_eos": body.ignore_eos,
            "speculative": body.speculative, "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "presence_penalty": body.presence_penalty,
            "frequency_penalty": body.frequency_penalty,
            "repetition_penalty": body.repetition_penalty, "min_tokens": body.min_tokens,
            "logit_bias": body.logit_bias_pairs() or None,
            "structured": None if structured is None else structured_spec(
                structured[1], structured[2], structured[0]),
        }, score_only

    async def _submit(self, body: CompletionRequest | ChatCompletionRequest,
                      rid: str, header_slo: dict[str, float] | None = None
                      ) -> list[Choice]:
        """Every choice, admitted: ``n`` per prompt, choice ``index`` = prompt * n + j (as
        OpenAI numbers them). A prompt's first choice is submitted as is and the other
        n-1 as its forks (they share its prompt pages); choice j's seed is seed + j.
        ``header_slo``: the SLO fields the request's headers set (the body's win)."""
        header_slo = header_slo or {}
        choices: list[Choice] = []
        engine = None
        try:
            engine = self.runtime.serving_engine()
            max_n = self.runtime.config.server.max_n
            if not 1 <= body.n <= max_n:
                raise FieldError("n", f"n must be in [1, {max_n}], got {body.n}")
            plan = self._plan(body)
            prompts = self._prompts(body, plan)
            c = body.slo_constraints
            slo = merge_slo(self.runtime.default_slo, header_slo, *(
                () if c is None else (c.ttft_ms, c.tbt_ms, c.priority_class)))
            echo = isinstance(body, CompletionRequest) and body.echo
            total = len(prompts) * body.n
            loop = asyncio.get_running_loop()
            for p, (token_ids, text) in enumerate(prompts):
                fields, score_only = self._sampling(body, len(token_ids),
                                                    engine.engine.config.model.max_model_len,
                                                    plan)
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
                    choices.append(Choice(index, stream, token_ids, prompt_text,
                                          sampling.logprobs, score_only, j == 0,
                                          output=None if plan is None else plan.parser))
            for choice in choices:
                await choice.stream.wait_admitted_async()
        except (ValueError, QueueFullError, EngineUnavailableError) as e:
            for choice in choices:
                self._abort(choice.stream.req_id)
            param = http_param(e.field, body) if isinstance(e, FieldError) else None
            raise HTTPError(status_of(e), str(e), param=param) from e
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

    async def generate(self, request: Request, cls: type) -> Response:
        """A completions (``cls``: its body model) or chat response, JSON or SSE."""
        body = await self.reader.generation_body(request, cls)
        try:
            header_slo = slo_from_headers(request.headers.get)
        except FieldError as e:
            raise HTTPError(400, str(e), param=e.field) from e
        chat = cls is ChatCompletionRequest
        rid = ("chatcmpl-" if chat else "cmpl-") + _new_id()
        choices = await self._submit(body, rid, header_slo)
        texts = self.texts()
        if body.stream:
            opts = body.stream_options
            include_usage = bool(opts and opts.include_usage)
            continuous = bool(opts and opts.continuous_usage_stats)
            return StreamingResponse(
                self._events(choices, rid, chat, include_usage, continuous, texts),
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
        results = [result(c, out.request, chat, texts)
                   for c, out in zip(choices, finals, strict=True)]
        make = chat_json if chat else completion_json
        return JSONResponse(make(rid, self.runtime.served_name, results,
                                 usage(choices, [r.summary for r in results])))

    def texts(self) -> TokenTexts:
        """Token texts of the served tokenizer (rebuilt when the tokenizer changes)."""
        tok = self.runtime.tokenizer
        if self._token_texts is None or self._token_texts_of is not tok:
            self._token_texts, self._token_texts_of = TokenTexts(tok), tok
        return self._token_texts

    async def _collect(self, request: Request, choices: list[Choice]) -> list[RequestOutput]:
        """Every choice's final output; aborts them all if the client goes away first."""
        async def last() -> list[RequestOutput]:
            final: dict[int, RequestOutput] = {}
            async for c, out in merge(choices):
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

    async def _events(self, choices: list[Choice], rid: str, chat: bool,
                      include_usage: bool, continuous: bool, texts: TokenTexts
                      ) -> AsyncIterator[str]:
        """The SSE body: the choices' chunks interleaved as their tokens come, each naming
        its ``index``. ``continuous`` (vLLM's ``continuous_usage_stats``) puts the
        choice's usage so far in every chunk; ``include_usage`` adds OpenAI's final usage
        chunk (every choice). A failure after the stream started ends it with an
        ``error`` event (and aborts the other choices)."""
        model = self.runtime.served_name
        with_usage = include_usage or continuous
        done: set[int] = set()
        summaries: dict[int, RequestSummary] = {}

        def usage_so_far(c: Choice, out: RequestOutput | None) -> dict[str, int] | None:
            if not continuous:
                return None
            n = 0 if out is None or c.score_only else len(out.request.output_token_ids)
            return usage_counts(len(c.prompt_ids), n)

        def chunk(c: Choice, text: str | None, out: RequestOutput | None,
                  **kw: Any) -> dict[str, Any]:
            return chunk_json(rid, model, chat, text, with_usage_field=with_usage,
                              usage=usage_so_far(c, out), index=c.index, **kw)

        merged = merge(choices)
        try:
            if chat:
                for c in choices:
                    yield sse(chunk(c, "", None, first=True))
            async for c, out in merged:
                if out.error is not None:
                    done.update(x.index for x in choices)
                    for other in choices:
                        self._abort(other.stream.req_id)
                    yield sse(error_json(500, out.error, code="engine_error"))
                    break
                if c.prompt_text is not None and not c.echoed:  # echo: the prompt first
                    c.echoed = True
                    lp = None if c.logprobs is None else c.completion_lp(texts).part(
                        c.prompt_ids, out.prompt_logprobs or [])
                    yield sse(chunk(c, c.prompt_text, out, logprobs=lp))
                new_tokens = out.new_token_ids and c.logprobs is not None
                if not c.score_only and (out.new_text or new_tokens):
                    lp = None
                    if c.logprobs is not None:
                        entries = out.logprobs or []
                        lp = (chat_logprobs(entries, texts) if chat else
                              c.completion_lp(texts).part(out.new_token_ids, entries))
                    for text, kw in _text_deltas(c, out, lp):
                        yield sse(chunk(c, text, out, **kw))
                if out.finished:
                    done.add(c.index)
                    s = RequestSummary.from_request(out.request)
                    summaries[c.index] = s
                    deltas, reason = _closing(c, "length" if c.score_only else s.finish_reason)
                    for delta in deltas:
                        yield sse(chunk(c, None, out, delta_fields=delta))
                    final = chunk(c, None if chat else "", out, finish_reason=reason)
                    if not include_usage:
                        final["superinfer"] = s.to_json()
                    yield sse(final)
            else:
                if include_usage:
                    ordered = [summaries[c.index] for c in choices]
                    yield sse(usage_chunk_json(rid, model, chat, usage(choices, ordered),
                                               ordered[0]))
            yield "data: [DONE]\n\n"
        except EngineUnavailableError as e:  # the whole engine went down mid-stream
            done.update(x.index for x in choices)
            yield sse(error_json(503, str(e), code="engine_unavailable"))
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


def _text_deltas(c: Choice, out: RequestOutput, lp: dict[str, Any] | None
                 ) -> list[tuple[str | None, dict[str, Any]]]:
    """(text, chunk fields) of each chunk for this output's new text: the text as it
    comes, or a parsed chat choice's deltas (the logprobs on the first)."""
    if not c.parsed:
        return [(out.new_text, {"logprobs": lp})]
    deltas = _parsed_deltas(c, out) or [{}]
    return [(None, {"delta_fields": d, "logprobs": lp if i == 0 else None})
            for i, d in enumerate(deltas) if d or lp is not None]


def _closing(c: Choice, reason: str) -> tuple[list[dict[str, Any]], str]:
    """A finished choice's last parsed deltas and its finish reason (``tool_calls``
    when it streamed calls)."""
    if not c.parsed:
        return [], reason
    deltas = _parsed_deltas(c, None)
    assert c.message_stream is not None
    return deltas, finish_reason(reason, c.message_stream.has_calls)


def _parsed_deltas(c: Choice, out: RequestOutput | None) -> list[dict[str, Any]]:
    """A parsed chat choice's deltas for this output's new text (None: the end)."""
    if c.message_stream is None:
        assert c.output is not None
        c.message_stream = c.output.stream()
    if out is None:
        return c.message_stream.finish()
    return c.message_stream.feed(out.new_text)


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
