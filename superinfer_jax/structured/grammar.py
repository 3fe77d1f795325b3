"""Grammar compilation and per-request token masks, on llguidance.

llguidance rather than outlines-core (``python -m benchmarks.grammar_mask``): it also
compiles Lark/GBNF grammars, which outlines-core's regex-only index cannot.

Bitmask layout (one row per request): ``ceil(vocab_size / 32)`` int32 words; token ``t``
is allowed iff bit ``t % 32`` (least significant first) of word ``t // 32`` is set. Ids at
or above the tokenizer's vocabulary (a padded embedding) are never allowed. A row of all
ones (-1) allows everything: unconstrained rows of a batch (``allocate_bitmask``).
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import llguidance
import numpy as np
import tokenizers

from superinfer_jax.request import FieldError
from superinfer_jax.structured.spec import StructuredOutputSpec

if TYPE_CHECKING:  # a TypedDict of llguidance's stub, absent at run time
    from llguidance._lib import JsonCompileOptions

# Compile errors quote the grammar around the error; enough to find it, bounded for logs.
_MAX_ERROR_CHARS = 2000


def bitmask_words(vocab_size: int) -> int:
    """Words in one mask row: 32 tokens per int32 word."""
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> np.ndarray:
    """A ``[rows, bitmask_words(vocab_size)]`` int32 array with every token allowed."""
    return np.full((rows, bitmask_words(vocab_size)), -1, dtype=np.int32)


def _tokenizer_json(tokenizer: tokenizers.Tokenizer | str) -> str:
    """The tokenizer as ``tokenizer.json`` text, without padding or truncation, which
    would change how llguidance tokenizes forced text."""
    text = tokenizer if isinstance(tokenizer, str) else tokenizer.to_str()
    data = json.loads(text)
    if data.get("padding") is None and data.get("truncation") is None:
        return text
    data["padding"] = None
    data["truncation"] = None
    return json.dumps(data)


class GrammarMatcher:
    """One request's position in its grammar; not thread-safe. A rejected token leaves it
    in an error state for good (``error`` says why): its mask then allows only EOS."""

    __slots__ = ("_m", "_words", "_vocab_size")

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self._m = matcher
        self._vocab_size = vocab_size
        self._words = bitmask_words(vocab_size)

    @property
    def words(self) -> int:
        return self._words

    def fill_bitmask(self, out: np.ndarray) -> None:
        """Write the next step's allowed tokens into ``out``, a C-contiguous int32 row of
        ``words`` words (layout: module docstring). Once terminated, only the EOS ids are set."""
        if out.dtype != np.int32 or out.shape != (self._words,) or not out.flags.c_contiguous:
            raise ValueError(f"bitmask row must be C-contiguous int32 of shape "
                             f"({self._words},), got {out.dtype} {out.shape}")
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it. Accepting
        EOS where the grammar may end terminates the matcher."""
        if token_id < 0:
            raise ValueError(f"token id must be >= 0, got {token_id}")
        return self._m.consume_token(int(token_id))

    def validate_tokens(self, token_ids: list[int]) -> int:
        """How many of ``token_ids``, in order, the grammar accepts from here; the state
        does not move (speculative decoding cuts a proposal there)."""
        return int(self._m.validate_tokens([int(t) for t in token_ids]))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        if num_tokens:
            self._m.rollback(num_tokens)

    def is_terminated(self) -> bool:
        """No token but EOS may follow: the grammar is complete and cannot be extended,
        EOS was accepted, or the matcher is in an error state."""
        return self._m.is_stopped()

    @property
    def error(self) -> str | None:
        """Why the matcher stopped in error (a rejected token), or None."""
        if not self._m.is_error():
            return None
        return self._m.get_error() or "rejected"


class CompiledGrammar:
    """A compiled spec: fresh matchers are copies of one, so the grammar is built once."""

    __slots__ = ("spec", "_template", "_vocab_size")

    def __init__(self, spec: StructuredOutputSpec, template: llguidance.LLMatcher,
                 vocab_size: int):
        self.spec = spec
        self._template = template
        self._vocab_size = vocab_size

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._template.deep_copy(), self._vocab_size)


class GrammarCompiler:
    """Compiles ``StructuredOutputSpec``s against one Hugging Face tokenizer (or its
    ``tokenizer.json`` text), with an LRU cache. Building it indexes the whole vocabulary:
    make one per model. ``compile`` may be called from any thread."""

    def __init__(self, tokenizer: tokenizers.Tokenizer | str, vocab_size: int,
                 eos_token_ids: Sequence[int], *, cache_size: int = 256,
                 whitespace_flexible: bool = True):
        eos = [int(e) for e in eos_token_ids]
        if not eos:
            raise ValueError("at least one EOS token id is needed to end a constrained output")
        text = _tokenizer_json(tokenizer)
        if isinstance(tokenizer, str):
            tokenizer = tokenizers.Tokenizer.from_str(text)
        base = tokenizer.get_vocab_size(with_added_tokens=True)
        if vocab_size < base:
            raise ValueError(f"vocab_size {vocab_size} is below the tokenizer's {base}")
        if any(not 0 <= e < base for e in eos):
            raise ValueError(f"EOS ids {eos} outside the tokenizer's vocabulary ({base})")
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos)
        self.cache_size = cache_size
        self.whitespace_flexible = whitespace_flexible
        self._tokenizer = llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos)
        # errors name the position in the grammar, not the parser's whole state
        self._limits = llguidance.LLParserLimits(verbose_errors=False)
        self._cache: OrderedDict[StructuredOutputSpec, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def words(self) -> int:
        return bitmask_words(self.vocab_size)

    def compile(self, spec: StructuredOutputSpec) -> CompiledGrammar:
        """The compiled grammar for ``spec``, from the cache when an equal spec was
        compiled before. A spec the backend rejects raises ``FieldError`` naming
        ``structured_outputs.<kind>`` with the backend's message."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        # Compiled outside the lock (llguidance drops the GIL): a large grammar must not
        # hold up cache hits; two threads compiling one spec both succeed, one is kept.
        compiled = CompiledGrammar(spec, self._build(spec), self.vocab_size)
        with self._lock:
            compiled = self._cache.setdefault(spec, compiled)
            self._cache.move_to_end(spec)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _grammar(self, spec: StructuredOutputSpec) -> str:
        options: JsonCompileOptions = {"whitespace_flexible": self.whitespace_flexible}
        match spec.kind:
            case "json":
                assert isinstance(spec.value, str)
                return llguidance.LLMatcher.grammar_from_json_schema(spec.value,
                                                                     defaults=options)
            case "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}',
                                                                     defaults=options)
            case "regex":
                assert isinstance(spec.value, str)
                return llguidance.LLMatcher.grammar_from_regex(spec.value)
            case "choice":
                assert isinstance(spec.value, tuple)
                return llguidance.grammar_from("choice", json.dumps(list(spec.value)))
            case "grammar":
                assert isinstance(spec.value, str)
                return llguidance.grammar_from("grammar", spec.value)
        raise AssertionError(spec.kind)  # StructuredOutputSpec validated the kind

    def _build(self, spec: StructuredOutputSpec) -> llguidance.LLMatcher:
        field = f"structured_outputs.{spec.kind}"
        try:
            grammar = self._grammar(spec)
        except ValueError as e:
            raise FieldError(field, str(e)[:_MAX_ERROR_CHARS]) from None
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0,
                                       limits=self._limits)
        if matcher.is_error():
            raise FieldError(field, matcher.get_error()[:_MAX_ERROR_CHARS])
        return matcher


def json_schema_problem(schema_json: str) -> str | None:
    """Why llguidance cannot compile this JSON schema (JSON text), or None if it can: the
    vocabulary-independent check, for a front to name the request field it came from
    before anything is submitted."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema_json)
        problem = llguidance.LLMatcher.validate_grammar(grammar)
    except ValueError as e:
        problem = str(e)
    return problem[:_MAX_ERROR_CHARS] or None


_executor: llguidance.LLExecutor | None = None
_executor_lock = threading.Lock()


def _default_executor() -> llguidance.LLExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = llguidance.LLExecutor()
        return _executor


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def fill_bitmasks(matchers: Sequence[GrammarMatcher], out: np.ndarray,
                  rows: Sequence[int] | None = None, *, parallel: bool | None = None) -> None:
    """Fill ``out[rows[k]]`` (C-contiguous int32 ``[batch, words]``) with ``matchers[k]``'s
    mask, other rows left as they are. ``parallel``: on llguidance's thread pool (GIL
    released); by default only with 4 or more CPUs, below which the hand-off costs more."""
    if not matchers:
        return
    words = matchers[0].words
    if (out.dtype != np.int32 or out.ndim != 2 or out.shape[1] != words
            or not out.flags.c_contiguous):
        raise ValueError(f"bitmask must be C-contiguous int32 [batch, {words}], "
                         f"got {out.dtype} {out.shape}")
    targets = range(len(matchers)) if rows is None else rows
    if len(targets) != len(matchers):
        raise ValueError(f"{len(matchers)} matchers for {len(targets)} rows")
    pairs = []
    for m, r in zip(matchers, targets, strict=True):
        if m.words != words:
            raise ValueError("matchers of different vocabulary sizes in one batch")
        if not 0 <= r < out.shape[0]:
            raise ValueError(f"row {r} outside the bitmask's {out.shape[0]} rows")
        pairs.append((m._m, int(r)))
    if parallel is None:
        parallel = _usable_cpus() >= 4
    if parallel:
        _default_executor().unsafe_compute_mask_ptr(pairs, out.ctypes.data, words * 4,
                                                    out.shape[0])
        return
    nbytes = words * 4
    for m_, r in pairs:
        m_.unsafe_compute_mask_ptr(out[r].ctypes.data, nbytes)
