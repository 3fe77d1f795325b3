"""Incremental detokenization for streaming, for any tokenizer with ``decode(ids)``.

Byte-level BPE splits multi-byte characters across tokens, so decoding one token at a time
yields replacement characters. As vLLM does, decode a short window of the previous tokens
plus the new ones and emit only the text past the window, holding back while the tail is
an incomplete character.
"""

from __future__ import annotations

from superinfer_jax.model_api import Tokenizer

_WINDOW = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_token_ids[-_WINDOW:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text (possibly empty)."""
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        if self.prefix_offset > 4 * _WINDOW:  # keep the window short
            drop = self.prefix_offset - _WINDOW
            self.ids = self.ids[drop:]
            self.prefix_offset -= drop
            self.read_offset -= drop
        return full[len(prefix):]
