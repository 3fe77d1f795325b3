"""What a constrained request asks for: one ``StructuredOutputSpec`` per request.

Types and sizes are checked when it is built, on the front's thread (a ``FieldError``
before the engine); whether the backend compiles it, by ``GrammarCompiler.compile``.
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

    - ``"json"``: a JSON Schema as JSON text (llguidance's subset; an unsupported keyword
      is a compile error); ``"json_object"``: None, any JSON object;
    - ``"regex"``: a Rust ``regex`` pattern the whole output matches;
    - ``"choice"``: a tuple of strings (a list is stored as one), the output is one of them;
    - ``"grammar"``: llguidance's Lark syntax (``start: ...``) or llama.cpp's GBNF
      (``root ::= ...``).
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
            # cheap here and the most common mistake; the schema's meaning is the backend's
            try:
                schema = json.loads(value)
            except ValueError as e:
                raise FieldError(field, f"not valid JSON: {e}") from None
            if not isinstance(schema, dict | bool):
                raise FieldError(field, "a JSON schema must be an object or a boolean")
