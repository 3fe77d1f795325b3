"""What a constrained request asks for: one ``StructuredOutputSpec`` per request.

The spec is validated for shape (types and sizes) when it is built, on the front's thread,
so an oversized or mistyped field is a ``FieldError`` before the request reaches the
engine; whether the backend can compile it is checked by ``GrammarCompiler.compile``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal, get_args

from superinfer_jax.request import FieldError

StructuredKind = Literal["json", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = get_args(StructuredKind)

# Compilation cost grows with the text (a schema's lexer, a grammar's rules), and compiled
# grammars are cached by their text, so every text field is bounded.
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 256


def _field(kind: str) -> str:
    return f"structured_outputs.{kind}"


@dataclass(frozen=True)
class StructuredOutputSpec:
    """A constraint on the generated text; equal specs share one compiled grammar.

    ``kind`` and ``value``:

    - ``"json"``: ``value`` is a JSON Schema, as JSON text (draft 2020-12 subset that
      llguidance implements; unsupported keywords are a compile error, not ignored).
    - ``"json_object"``: ``value`` is None; any JSON object (OpenAI's ``json_object``).
    - ``"regex"``: ``value`` is a pattern in Rust ``regex`` syntax (no look-around, no
      back-references); the whole output must match it, as with ``re.fullmatch``.
    - ``"choice"``: ``value`` is a tuple of strings; the output is exactly one of them.
      A list is accepted and stored as a tuple (the spec must be hashable).
    - ``"grammar"``: ``value`` is a context-free grammar in llguidance's Lark syntax
      (``start: ...``, https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md)
      or in llama.cpp's GBNF (``root ::= ...``), which is converted to Lark.
    """

    kind: StructuredKind
    value: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        kind = self.kind
        if kind not in KINDS:
            raise FieldError("structured_outputs", f"unknown kind {kind!r}; expected one of "
                             f"{', '.join(KINDS)}")
        field = _field(kind)
        value = self.value
        if kind == "json_object":
            if value is not None:
                raise FieldError(field, "json_object takes no value")
            return
        if kind == "choice":
            if isinstance(value, list):
                value = tuple(value)
                object.__setattr__(self, "value", value)
            if not isinstance(value, tuple) or not all(isinstance(c, str) for c in value):
                raise FieldError(field, "must be a list of strings")
            if not 1 <= len(value) <= MAX_CHOICES:
                raise FieldError(field, f"must have 1 to {MAX_CHOICES} entries, "
                                        f"got {len(value)}")
            if sum(len(c) for c in value) > MAX_SPEC_CHARS:
                raise FieldError(field, f"choices exceed {MAX_SPEC_CHARS} characters in all")
            return
        if not isinstance(value, str):
            raise FieldError(field, f"must be a string, got {type(value).__name__}")
        if not value:
            raise FieldError(field, "must not be empty")
        if len(value) > MAX_SPEC_CHARS:
            raise FieldError(field, f"exceeds {MAX_SPEC_CHARS} characters ({len(value)})")
        if kind == "json":
            # Cheap here and the most common mistake; the schema's meaning is the
            # backend's to check.
            try:
                schema = json.loads(value)
            except ValueError as e:
                raise FieldError(field, f"not valid JSON: {e}") from None
            if not isinstance(schema, dict | bool):
                raise FieldError(field, "a JSON schema must be an object or a boolean")
