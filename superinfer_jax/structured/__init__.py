"""Structured outputs: constrain generation to a JSON schema, regex, choice or grammar.

The engine compiles each constrained request's ``StructuredOutputSpec`` once
(``GrammarCompiler.compile``, cached), gives the request a ``GrammarMatcher``, and each
step fills the packed token bitmask (``fill_bitmasks``) that the device applies to the
logits, then advances the matcher with the sampled token (``accept_token``). This package
takes the vocabulary as a Hugging Face tokenizer; it never imports ``models``.
"""

from superinfer_jax.structured.grammar import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarMatcher,
    allocate_bitmask,
    bitmask_words,
    fill_bitmasks,
)
from superinfer_jax.structured.spec import (
    MAX_CHOICES,
    MAX_SPEC_CHARS,
    StructuredKind,
    StructuredOutputSpec,
)

__all__ = [
    "MAX_CHOICES",
    "MAX_SPEC_CHARS",
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarMatcher",
    "StructuredKind",
    "StructuredOutputSpec",
    "allocate_bitmask",
    "bitmask_words",
    "fill_bitmasks",
]
