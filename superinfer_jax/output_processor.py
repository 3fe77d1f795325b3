"""The output processor: what a sampled token means for its request.

Everything between a token id on the host and a streamed delta, as vLLM V1's output
processor: detokenization, the stop and length decisions, and the text safe to stream
(held back while it could start a stop string). ``at_length_limit`` is shared with the
engine's in-flight prediction and the simulator, so all three agree on when a request ends.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

from superinfer_jax.detokenize import IncrementalDetokenizer
from superinfer_jax.model_api import Tokenizer
from superinfer_jax.request import Request, RequestStatus, TokenLogprobs

if TYPE_CHECKING:
    from superinfer_jax.runner.input_batch import CallRow
    from superinfer_jax.runner.logits import HostLogprobs


def at_length_limit(num_prompt_tokens: int, num_outputs: int, max_tokens: int,
                    max_model_len: int) -> bool:
    """Whether ``num_outputs`` output tokens reach ``max_tokens`` or ``max_model_len``."""
    return num_outputs >= max_tokens or num_prompt_tokens + num_outputs >= max_model_len


@dataclass
class RequestOutput:
    """What one step produced for one request: a delta for streaming. ``error``: the
    engine failed this request alone, which is finished (aborted)."""

    req_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    request: Request
    error: str | None = None
    # When the sampling asks for logprobs: one per new token; the prompt's once, on the
    # request's first output (position 0 is None).
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class TokenOutcome:
    """One landed token: the request's finish status (None: it goes on), the text delta
    safe to stream now, and whether it is the request's first output token."""

    finish: RequestStatus | None
    delta: str
    first: bool = False


class OutputProcessor:
    """Detokenizers and stop/length decisions for the requests of one engine."""

    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: Collection[int],
                 max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.max_model_len = max_model_len
        self._detok: dict[str, IncrementalDetokenizer] = {}

    def add(self, req: Request) -> None:
        if self.tokenizer is not None:
            self._detok[req.req_id] = IncrementalDetokenizer(self.tokenizer,
                                                             req.prompt_token_ids)

    def remove(self, req_id: str) -> None:
        self._detok.pop(req_id, None)

    def at_length_limit(self, req: Request, num_outputs: int) -> bool:
        """Whether ``num_outputs`` output tokens end ``req`` by length."""
        return at_length_limit(len(req.prompt_token_ids), num_outputs,
                               req.sampling.max_tokens, self.max_model_len)

    def land(self, req: Request, token: int, now: float) -> TokenOutcome:
        """Append a sampled token to ``req`` (its grammar must accept it), detokenize it
        and decide whether it ends the request; the caller finishes it then."""
        grammar = req.grammar
        if grammar is not None and not grammar.accept_token(token):
            raise RuntimeError(f"structured output: the grammar rejected token {token} "
                               f"({grammar.error})")
        first = not req.output_token_ids
        req.num_inflight_tokens -= 1
        req.output_token_ids.append(token)
        req.token_times.append(now)
        detok = self._detok.get(req.req_id)
        text = req.output_text + (detok.push(token) if detok else "")
        reason, text = self._stop_reason(req, token, text)
        if reason is not None and detok is not None and reason != RequestStatus.FINISHED_STOPPED:
            text += detok.flush()  # an incomplete character at the very end
        req.output_text = text
        delta = self._emit_text(req, finished=reason is not None)
        if reason is None and grammar is not None and grammar.is_terminated():
            reason = RequestStatus.FINISHED_STOPPED  # complete: only EOS could follow
            delta += req.output_text[req.num_emitted_chars:]  # nothing is held back now
            req.num_emitted_chars = len(req.output_text)
        return TokenOutcome(reason, delta, first)

    @staticmethod
    def request_output(req: Request, token: int, outcome: TokenOutcome) -> RequestOutput:
        """The streamed output of a landed token (after its request was finished, when
        it ends it), with the logprobs the request asked for."""
        out = RequestOutput(req.req_id, [token], outcome.delta, outcome.finish is not None,
                            req.status.finish_reason, req)
        if req.sampling.logprobs is not None and req.pending_logprobs is not None:
            req.output_logprobs.append(req.pending_logprobs)
            out.logprobs = [req.pending_logprobs]
            req.pending_logprobs = None
        if outcome.first and req.sampling.prompt_logprobs is not None:
            out.prompt_logprobs = list(req.prompt_logprobs)
        return out

    @staticmethod
    def _emit_text(req: Request, finished: bool) -> str:
        """Text safe to stream: hold back what could still turn out to start a stop string."""
        end = len(req.output_text)
        if req.sampling.stop and not finished:
            end -= max(len(s) for s in req.sampling.stop) - 1
        end = max(end, req.num_emitted_chars)
        delta = req.output_text[req.num_emitted_chars:end]
        req.num_emitted_chars = end
        return delta

    def _stop_reason(self, req: Request, token: int,
                     text: str) -> tuple[RequestStatus | None, str]:
        """(finish status or None, output text cut before a stop string if one appeared)."""
        sp = req.sampling
        if sp.stop:
            search_from = max(0, len(req.output_text) - max(len(s) for s in sp.stop) + 1)
            hits = [i for i in (text.find(s, search_from) for s in sp.stop) if i >= 0]
            if hits:
                return RequestStatus.FINISHED_STOPPED, text[:min(hits)]
        if token in sp.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, text
        if not sp.ignore_eos and token in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, text
        if self.at_length_limit(req, len(req.output_token_ids)):
            return RequestStatus.FINISHED_LENGTH, text
        return None, text


def land_logprobs(req: Request, lp: HostLogprobs, b: int, row: CallRow, token: int) -> None:
    """Keep a call row's logprobs on its request: the prompt positions it computed (once
    each), and the sampled token's on a final row (``request_output`` hands it out)."""
    sp = req.sampling
    if sp.prompt_logprobs is not None:
        if not req.prompt_logprobs:
            req.prompt_logprobs.append(None)  # nothing predicts the first token
        prompt = req.prompt_token_ids
        for j in range(row.num_tokens):
            pos = row.start + j + 1  # the prompt position column j predicts
            if pos >= len(prompt):
                break
            if pos == len(req.prompt_logprobs):
                req.prompt_logprobs.append(lp.prompt(b, j, prompt[pos], sp.prompt_logprobs))
    if row.final and sp.logprobs is not None:
        req.pending_logprobs = lp.sampled(b, token, sp.logprobs)
