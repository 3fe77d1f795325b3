"""Structured outputs: constrain generation to a JSON schema, regex, choice or grammar.

Each constrained request's spec compiles once (cached) into a ``GrammarMatcher``; each
step fills the token bitmask the device applies to the logits, then advances the matcher
with the sampled token. The vocabulary comes as a Hugging Face tokenizer.
"""

from superinfer_jax.structured.grammar import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarMatcher,
    allocate_bitmask,
    bitmask_words,
    fill_bitmasks,
    json_schema_problem,
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
    "json_schema_problem",
]
