"""Logprobs in OpenAI's two response shapes, from the engine's ``TokenLogprobs``.

Token strings are what vLLM returns: each token id decoded alone, special tokens kept
(``decode([id], skip_special_tokens=False)``). A byte-level BPE token that holds part
of a multi-byte character decodes to U+FFFD there; its ``bytes`` (chat) are still the
token's true bytes (from the vocabulary's byte alphabet), so a client that joins the
``bytes`` of every token gets the exact UTF-8 of the text, which is what OpenAI's
``bytes`` field is for.

Logprobs are finite in JSON: a token masked to -inf (``logit_bias`` of -100, a grammar)
reports -9999.0, as vLLM does (JSON has no infinity).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from superinfer_jax.request import TokenLogprobs

MIN_LOGPROB = -9999.0
_REPLACEMENT = "\ufffd"
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-printable-character map, inverted: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_BYTE_OF = _byte_level_alphabet()


def finite(logprob: float) -> float:
    """A logprob JSON can carry: -inf and NaN become ``MIN_LOGPROB``."""
    if math.isnan(logprob) or logprob < MIN_LOGPROB:
        return MIN_LOGPROB
    return float(logprob)


class TokenTexts:
    """Token id -> its string and its bytes, cached (the same ids come back often)."""

    def __init__(self, tokenizer: Any):
        self._tok = tokenizer
        self.text = lru_cache(maxsize=1 << 16)(self._text)
        self.bytes = lru_cache(maxsize=1 << 16)(self._bytes)

    def _text(self, token_id: int) -> str:
        if self._tok is None:
            return f"token_id:{token_id}"
        try:
            text = self._tok.decode([token_id], skip_special_tokens=False)
        except TypeError:  # a tokenizer without the keyword
            text = self._tok.decode([token_id])
        return text if isinstance(text, str) else ""

    def _bytes(self, token_id: int) -> list[int]:
        text = self.text(token_id)
        if _REPLACEMENT in text:
            raw = self._raw_bytes(token_id)
            if raw is not None:
                return raw
        return list(text.encode("utf-8"))

    def _raw_bytes(self, token_id: int) -> list[int] | None:
        """A partial character's bytes, from the token's vocabulary string: byte-level
        BPE (every character in GPT-2's byte alphabet) or a byte-fallback ``<0xAB>``."""
        id_to_token = getattr(self._tok, "id_to_token", None)
        piece = id_to_token(token_id) if id_to_token is not None else None
        if not isinstance(piece, str) or not piece:
            return None
        match = _BYTE_FALLBACK.fullmatch(piece)
        if match:
            return [int(match.group(1), 16)]
        if all(c in _BYTE_OF for c in piece):
            return [_BYTE_OF[c] for c in piece]
        return None


def chat_logprobs(entries: Sequence[TokenLogprobs], texts: TokenTexts) -> dict[str, Any]:
    """``choices[i].logprobs`` of a chat completion (or of one chunk's tokens)."""
    def one(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": texts.text(token_id), "logprob": finite(logprob),
                "bytes": texts.bytes(token_id)}

    return {"content": [
        {**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
        for e in entries]}


class CompletionLogprobs:
    """``choices[i].logprobs`` of a legacy completion, built position by position (a
    stream sends each chunk's part; ``text_offset`` runs on across chunks).

    ``top_logprobs[i]`` maps token strings to logprobs: the top-k and, always, the token
    at that position (OpenAI: up to k+1 entries). Two ids with one string keep the higher
    logprob. A position without logprobs (the prompt's first token) is null in
    ``token_logprobs`` and ``top_logprobs``."""

    def __init__(self, texts: TokenTexts, text_offset: int = 0):
        self.texts = texts
        self.offset = text_offset

    def part(self, token_ids: Sequence[int],
             entries: Sequence[TokenLogprobs | None]) -> dict[str, Any]:
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for i, token_id in enumerate(token_ids):
            entry = entries[i] if i < len(entries) else None
            text = self.texts.text(token_id)
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
            if entry is None:
                token_logprobs.append(None)
                tops.append(None)
                continue
            top: dict[str, float] = {}
            for t, lp in (*entry.top, (entry.token_id, entry.logprob)):
                key, value = self.texts.text(t), finite(lp)
                if key not in top or top[key] < value:
                    top[key] = value
            token_logprobs.append(finite(entry.logprob))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}
