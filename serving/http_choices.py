"""A generation response's choices: one engine request each, their outputs merged as they
come, and a finished choice in the response's terms (text, echo, logprobs, usage)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from serving.logprobs import CompletionLogprobs, TokenTexts, chat_logprobs
from serving.openai_schema import ChoiceResult, usage_json
from serving.requests import RequestSummary
from serving.tools import MessageStream, OutputParser, finish_reason
from superinfer_jax.async_engine import RequestStream
from superinfer_jax.engine import RequestOutput
from superinfer_jax.request import Request as EngineRequest


@dataclass
class Choice:
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
    # chat: reads the text into content, reasoning and tool calls (``serving.tools``);
    # None or ``plain``: the text is the content
    output: OutputParser | None = None
    message_stream: MessageStream | None = None

    @property
    def parsed(self) -> bool:
        return self.output is not None and not self.output.plain

    def completion_lp(self, texts: TokenTexts) -> CompletionLogprobs:
        """The choice's legacy-logprobs builder (``text_offset`` runs on over chunks)."""
        if self._lp is None:
            self._lp = CompletionLogprobs(texts)
        return self._lp


async def merge(choices: list[Choice]) -> AsyncGenerator[tuple[Choice, RequestOutput], None]:
    """Every choice's outputs, in the order they come, until each has finished; a stream
    that raises (the engine went down) raises here."""
    queue: asyncio.Queue[tuple[Choice, RequestOutput | BaseException]] = asyncio.Queue()

    async def pump(c: Choice) -> None:
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


def result(c: Choice, req: EngineRequest, chat: bool, texts: TokenTexts) -> ChoiceResult:
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
    out = ChoiceResult(c.index, text, "length" if c.score_only else s.finish_reason,
                       logprobs, s)
    if chat and c.output is not None and c.parsed:
        message = c.output.final(text)
        out.message = message.message_json()
        out.openai_finish = finish_reason(out.finish_reason, bool(message.tool_calls))
    return out


def usage(choices: list[Choice], summaries: list[RequestSummary]) -> dict[str, Any]:
    """The usage of every choice: each prompt's tokens once, every choice's output."""
    prompt = cached = completion = 0
    for c, s in zip(choices, summaries, strict=True):
        if c.first_of_prompt:
            prompt += s.prompt_tokens
            cached += s.cached_prompt_tokens
        completion += 0 if c.score_only else s.completion_tokens
    return usage_json(prompt, completion, cached)


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event carrying ``payload``."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
