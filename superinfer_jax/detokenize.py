"""Incremental detokenization for streaming, for any tokenizer with ``decode(ids)``."""

from __future__ import annotations

from collections.abc import Sequence

from superinfer_jax.model_api import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas for streaming responses.

    Decoding one token at a time is wrong (a byte-level token can end inside a UTF-8
    character; SentencePiece drops a first token's leading space), so each step decodes a
    short window from the last complete point and holds back a trailing replacement
    character. ``push`` deltas plus ``flush`` concatenate to ``decode(all_ids)``.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        # A few prompt tokens give the first generated token its left context.
        self._ids: list[int] = [int(t) for t in prompt_ids[-4:]]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""

    def _decode(self, start: int, stop: int | None = None) -> str:
        ids = self._ids[start:stop]
        if self._skip:  # every tokenizer's default
            return self._tokenizer.decode(ids)
        return self._tokenizer.decode(ids, skip_special_tokens=False)  # type: ignore[call-arg]

    def _advance(self, final: bool) -> str:
        prefix = self._decode(self._prefix_offset, self._read_offset)
        full = self._decode(self._prefix_offset)
        if not final and (len(full) <= len(prefix) or full.endswith(_REPLACEMENT_CHAR)):
            return ""
        delta = full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += delta
        return delta

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it completes (possibly "")."""
        self._ids.append(int(token_id))
        return self._advance(final=False)

    def flush(self) -> str:
        """Emit whatever is still held back (e.g. an incomplete character at the end)."""
        return self._advance(final=True)
