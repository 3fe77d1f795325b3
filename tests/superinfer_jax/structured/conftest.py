"""SmolLM2's tokenizer, rebuilt from the embedded GGUF's metadata only (no weights), and
compilers over it, once per session: building a compiler indexes all 49,152 tokens."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import tokenizers

from superinfer_jax.structured import GrammarCompiler


@dataclass(frozen=True)
class Vocab:
    tokenizer: tokenizers.Tokenizer
    eos_token_ids: tuple[int, ...]
    size: int


@pytest.fixture(scope="session")
def vocab(smollm2_tokenizer) -> Vocab:
    tok = smollm2_tokenizer
    return Vocab(tok.backend, tok.eos_token_ids, tok.vocab_size)


@pytest.fixture(scope="session")
def compiler(vocab: Vocab) -> GrammarCompiler:
    """llguidance's defaults: flexible whitespace between JSON tokens."""
    return GrammarCompiler(vocab.tokenizer, vocab.size, vocab.eos_token_ids)


@pytest.fixture(scope="session")
def strict_compiler(vocab: Vocab) -> GrammarCompiler:
    """No free whitespace in JSON, so random walks over a bounded schema end quickly."""
    return GrammarCompiler(vocab.tokenizer, vocab.size, vocab.eos_token_ids,
                           whitespace_flexible=False)
