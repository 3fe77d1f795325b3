"""Grammar matchers on SmolLM2's vocabulary: every output a mask-following walk produces is
valid for its spec, bad tokens and bad specs are refused, and the bitmask layout is the one
the device unpacks."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import jsonschema
import numpy as np
import pytest

from superinfer_jax.request import FieldError
from superinfer_jax.structured import (
    MAX_CHOICES,
    MAX_SPEC_CHARS,
    GrammarCompiler,
    GrammarMatcher,
    StructuredOutputSpec,
    allocate_bitmask,
    bitmask_words,
    fill_bitmasks,
)

EOS = 2  # SmolLM2's <|im_end|>
CAP = 200  # tokens per walk; every bounded spec below ends well before

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["x", "y", 3]},
    },
    "required": ["name", "age", "tags", "ok", "kind"],
    "additionalProperties": False,
}


def allowed_ids(row: np.ndarray, vocab_size: int) -> np.ndarray:
    """Token ids whose bit is set, read the way the device reads the row."""
    ids = np.arange(vocab_size)
    bits = (row[ids // 32] >> (ids % 32)) & 1
    return np.flatnonzero(bits)


Chooser = Callable[[np.ndarray], int]


def random_chooser(seed: int, p_eos: float = 0.5) -> Chooser:
    """A seeded random allowed token; EOS with probability ``p_eos`` once it is allowed,
    so walks over finite languages end."""
    rng = np.random.default_rng(seed)

    def choose(allowed: np.ndarray) -> int:
        if EOS in allowed and rng.random() < p_eos:
            return EOS
        others = allowed[allowed != EOS]
        return int(rng.choice(others)) if others.size else EOS

    return choose


def lowest_chooser(allowed: np.ndarray) -> int:
    return int(allowed[0])


def walk(matcher: GrammarMatcher, choose: Chooser, vocab_size: int,
         cap: int = CAP) -> tuple[list[int], bool]:
    """Generate under the mask until EOS or ``cap`` tokens; (tokens before EOS, ended).
    Checks on the way that the chosen token is accepted and that a terminated matcher
    allows only EOS."""
    row = np.zeros(bitmask_words(vocab_size), np.int32)
    out: list[int] = []
    for _ in range(cap):
        matcher.fill_bitmask(row)
        allowed = allowed_ids(row, vocab_size)
        assert allowed.size, f"empty mask after {out}"
        if matcher.is_terminated():
            assert allowed.tolist() == [EOS]
        token = choose(allowed)
        assert matcher.accept_token(token), matcher.error
        if token == EOS:
            assert matcher.is_terminated()
            return out, True
        out.append(token)
    return out, False


def feed(matcher: GrammarMatcher, ids: list[int], vocab_size: int) -> None:
    """Drive with given tokens, each of which must be allowed by the mask first."""
    row = np.zeros(bitmask_words(vocab_size), np.int32)
    for t in ids:
        matcher.fill_bitmask(row)
        assert (row[t // 32] >> (t % 32)) & 1, f"token {t} masked off"
        assert matcher.accept_token(t), matcher.error


def decode(vocab, ids: list[int]) -> str:
    return vocab.tokenizer.decode(ids, skip_special_tokens=False)


# ---------------------------------------------------------------------- JSON schema
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_json_schema_random_walks_validate(strict_compiler, vocab, seed):
    spec = StructuredOutputSpec("json", json.dumps(PERSON))
    ids, ended = walk(strict_compiler.compile(spec).matcher(), random_chooser(seed), vocab.size)
    assert ended
    jsonschema.validate(json.loads(decode(vocab, ids)), PERSON)


def test_json_schema_lowest_token_walk_validates(strict_compiler, vocab):
    spec = StructuredOutputSpec("json", json.dumps(PERSON))
    ids, ended = walk(strict_compiler.compile(spec).matcher(), lowest_chooser, vocab.size)
    assert ended
    jsonschema.validate(json.loads(decode(vocab, ids)), PERSON)


def test_json_schema_indented_document_then_only_eos(compiler, vocab):
    doc = {"name": "Ann", "age": 41, "tags": ["b", "a"], "ok": True, "kind": 3}
    m = compiler.compile(StructuredOutputSpec("json", json.dumps(PERSON))).matcher()
    feed(m, vocab.tokenizer.encode(json.dumps(doc, indent=2)).ids, vocab.size)
    assert m.is_terminated() and m.error is None
    row = np.zeros(compiler.words, np.int32)
    m.fill_bitmask(row)
    assert allowed_ids(row, vocab.size).tolist() == [EOS]


def test_json_schema_rejects_a_value_the_schema_forbids(compiler, vocab):
    m = compiler.compile(StructuredOutputSpec("json", json.dumps(PERSON))).matcher()
    prefix = vocab.tokenizer.encode('{"name": "Ann", "age": ').ids
    feed(m, prefix, vocab.size)
    assert not m.accept_token(vocab.tokenizer.token_to_id("-"))  # minimum is 0
    assert m.error and m.is_terminated()


# ---------------------------------------------------------------------- json_object
def test_json_object_accepts_any_object(compiler, vocab):
    doc = {"a": [1, 2.5e-3, None, {"b": "é\n\"x\""}], "c": {}, "d": False}
    m = compiler.compile(StructuredOutputSpec("json_object")).matcher()
    text = json.dumps(doc, ensure_ascii=False)
    feed(m, vocab.tokenizer.encode(text).ids, vocab.size)
    assert m.is_terminated()


def test_json_object_rejects_a_top_level_array(compiler, vocab):
    m = compiler.compile(StructuredOutputSpec("json_object")).matcher()
    assert not m.accept_token(vocab.tokenizer.token_to_id("["))


@pytest.mark.parametrize("seed", [0, 1])
def test_json_object_walk_stays_a_json_prefix(strict_compiler, vocab, seed):
    """Unbounded, so the walk may not end; whatever it produced must parse once ended,
    and must start an object in any case."""
    m = strict_compiler.compile(StructuredOutputSpec("json_object")).matcher()
    ids, ended = walk(m, random_chooser(seed, p_eos=1.0), vocab.size, cap=60)
    text = decode(vocab, ids)
    assert text.startswith("{")
    if ended:
        assert isinstance(json.loads(text), dict)


# ---------------------------------------------------------------------- regex
REGEXES = [
    r"(\+1 )?[0-9]{3}-[0-9]{4}",
    r"[a-z]{1,6}@example\.(com|org)",
    r"(true|false|null|-?[1-9][0-9]{0,3})",
]


@pytest.mark.parametrize("pattern", REGEXES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_regex_walks_fullmatch(compiler, vocab, pattern, seed):
    m = compiler.compile(StructuredOutputSpec("regex", pattern)).matcher()
    ids, ended = walk(m, random_chooser(seed), vocab.size)
    assert ended
    assert re.fullmatch(pattern, decode(vocab, ids))


def test_regex_rejects_a_token_outside_it(compiler, vocab):
    m = compiler.compile(StructuredOutputSpec("regex", REGEXES[0])).matcher()
    feed(m, vocab.tokenizer.encode("555").ids, vocab.size)
    assert not m.accept_token(vocab.tokenizer.token_to_id("5"))  # "-" must come next


# ---------------------------------------------------------------------- choice
CHOICES = ("no", "none", "maybe later", 'say "hi"', "naïve", "日本", "back\\slash")


@pytest.mark.parametrize("seed", range(6))
def test_choice_walks_end_in_a_choice(compiler, vocab, seed):
    m = compiler.compile(StructuredOutputSpec("choice", CHOICES)).matcher()
    ids, ended = walk(m, random_chooser(seed), vocab.size)
    assert ended and decode(vocab, ids) in CHOICES


@pytest.mark.parametrize("choice", CHOICES)
def test_every_choice_is_reachable(compiler, vocab, choice):
    m = compiler.compile(StructuredOutputSpec("choice", CHOICES)).matcher()
    feed(m, vocab.tokenizer.encode(choice).ids + [EOS], vocab.size)
    assert m.is_terminated() and m.error is None


def test_choice_prefix_of_another_allows_both_eos_and_more(compiler, vocab):
    m = compiler.compile(StructuredOutputSpec("choice", CHOICES)).matcher()
    feed(m, vocab.tokenizer.encode("no").ids, vocab.size)
    row = np.zeros(compiler.words, np.int32)
    m.fill_bitmask(row)
    allowed = allowed_ids(row, vocab.size)
    assert EOS in allowed and vocab.tokenizer.token_to_id("ne") in allowed
    assert not m.is_terminated()


# ---------------------------------------------------------------------- grammar
LARK = """
start: greeting " " name "!"
greeting: "hello" | "hi"
name: /[A-Z][a-z]{1,7}/
"""
GBNF = 'root ::= ("yes" | "no") " " [0-9] [0-9]?'


@pytest.mark.parametrize(("grammar", "pattern"), [
    (LARK, r"(hello|hi) [A-Z][a-z]{1,7}!"),
    (GBNF, r"(yes|no) [0-9][0-9]?"),
])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grammar_walks_match_the_language(compiler, vocab, grammar, pattern, seed):
    m = compiler.compile(StructuredOutputSpec("grammar", grammar)).matcher()
    ids, ended = walk(m, random_chooser(seed), vocab.size)
    assert ended
    assert re.fullmatch(pattern, decode(vocab, ids))


# ---------------------------------------------------------------------- matcher contract
def test_rejected_token_puts_matcher_in_error_with_only_eos(compiler, vocab):
    m = compiler.compile(StructuredOutputSpec("regex", "[0-9]+")).matcher()
    row = np.zeros(compiler.words, np.int32)
    m.fill_bitmask(row)
    disallowed = int(np.flatnonzero(((row[np.arange(vocab.size) // 32]
                                      >> (np.arange(vocab.size) % 32)) & 1) == 0)[100])
    assert m.error is None
    assert not m.accept_token(disallowed)
    assert m.error and m.is_terminated()
    m.fill_bitmask(row)
    assert allowed_ids(row, vocab.size).tolist() == [EOS]


def test_terminated_row_is_exactly_the_eos_bit(compiler, vocab):
    """The layout, concretely: token 2 is bit 2 of word 0, so an EOS-only row is
    [4, 0, 0, ...]; np.unpackbits(bitorder='little') reads the same bits."""
    m = compiler.compile(StructuredOutputSpec("choice", ("ok",))).matcher()
    feed(m, vocab.tokenizer.encode("ok").ids, vocab.size)
    assert m.is_terminated()
    row = np.full(compiler.words, -1, np.int32)
    m.fill_bitmask(row)
    assert row[0] == 1 << EOS and not row[1:].any()
    unpacked = np.unpackbits(row.view(np.uint8), bitorder="little")
    assert np.flatnonzero(unpacked).tolist() == [EOS]


def test_bit_31_reads_as_set_with_int32_shift():
    """Token 31 of a word is its sign bit: the arithmetic shift must still read 1."""
    row = np.array([np.int32(-2**31)], np.int32)
    assert allowed_ids(row, 32).tolist() == [31]


def test_matchers_of_one_grammar_are_independent(compiler, vocab):
    compiled = compiler.compile(StructuredOutputSpec("choice", ("alpha", "beta")))
    a, b = compiled.matcher(), compiled.matcher()
    feed(a, vocab.tokenizer.encode("alpha").ids, vocab.size)
    feed(b, vocab.tokenizer.encode("beta").ids, vocab.size)
    assert a.is_terminated() and b.is_terminated()
    fresh = compiled.matcher()
    assert not fresh.is_terminated()
    feed(fresh, vocab.tokenizer.encode("beta").ids, vocab.size)


@pytest.mark.parametrize("parallel", [False, True])
def test_fill_bitmasks_matches_single_fills_on_the_given_rows(compiler, vocab, parallel):
    specs = [StructuredOutputSpec("json", json.dumps(PERSON)),
             StructuredOutputSpec("regex", REGEXES[1]),
             StructuredOutputSpec("json_object")]
    matchers = [compiler.compile(s).matcher() for s in specs]
    feed(matchers[0], vocab.tokenizer.encode('{"name": "A').ids, vocab.size)
    feed(matchers[1], vocab.tokenizer.encode("ab").ids, vocab.size)
    batch = allocate_bitmask(5, vocab.size)
    rows = [4, 0, 2]
    fill_bitmasks(matchers, batch, rows, parallel=parallel)
    for m, r in zip(matchers, rows, strict=True):
        single = np.zeros(compiler.words, np.int32)
        m.fill_bitmask(single)
        assert np.array_equal(batch[r], single)
    assert (batch[[1, 3]] == -1).all()  # unconstrained rows untouched
    assert not np.array_equal(batch[0], batch[4])


def test_fill_bitmask_checks_the_row(compiler):
    m = compiler.compile(StructuredOutputSpec("json_object")).matcher()
    with pytest.raises(ValueError, match="int32"):
        m.fill_bitmask(np.zeros(compiler.words, np.int64))
    with pytest.raises(ValueError, match="shape"):
        m.fill_bitmask(np.zeros(compiler.words - 1, np.int32))


def test_ids_past_the_tokenizer_vocabulary_are_masked_off(vocab):
    padded = vocab.size + 40  # an embedding padded past the tokenizer
    comp = GrammarCompiler(vocab.tokenizer, padded, vocab.eos_token_ids)
    assert comp.words == bitmask_words(padded) == 1538
    m = comp.compile(StructuredOutputSpec("json", '{"type": "string"}')).matcher()
    row = np.full(comp.words, -1, np.int32)
    m.fill_bitmask(row)
    assert row[0] != 0  # something is allowed at the start ('"')
    feed(m, vocab.tokenizer.encode('"ab').ids, padded)
    m.fill_bitmask(row)
    allowed = allowed_ids(row, 32 * comp.words)
    assert allowed.size > 40_000  # inside a string almost every token fits
    assert allowed.max() < vocab.size
    assert not m.accept_token(vocab.size + 5)


def test_compiler_rejects_a_vocab_smaller_than_the_tokenizer(vocab):
    with pytest.raises(ValueError, match="below"):
        GrammarCompiler(vocab.tokenizer, vocab.size - 1, vocab.eos_token_ids)
    with pytest.raises(ValueError, match="EOS"):
        GrammarCompiler(vocab.tokenizer, vocab.size, ())


def test_compiler_takes_tokenizer_json_text(vocab):
    comp = GrammarCompiler(vocab.tokenizer.to_str(), vocab.size, vocab.eos_token_ids)
    m = comp.compile(StructuredOutputSpec("choice", ("yes",))).matcher()
    feed(m, vocab.tokenizer.encode("yes").ids, vocab.size)
    assert m.is_terminated()


# ---------------------------------------------------------------------- cache
def test_equal_specs_share_one_compiled_grammar(compiler):
    a = compiler.compile(StructuredOutputSpec("json", json.dumps(PERSON)))
    b = compiler.compile(StructuredOutputSpec("json", json.dumps(PERSON)))
    c = compiler.compile(StructuredOutputSpec("choice", ["x", "y"]))
    d = compiler.compile(StructuredOutputSpec("choice", ("x", "y")))
    assert a is b and c is d and a is not c


def test_cache_evicts_least_recently_used(vocab):
    comp = GrammarCompiler(vocab.tokenizer, vocab.size, vocab.eos_token_ids, cache_size=2)
    s1, s2, s3 = (StructuredOutputSpec("regex", p) for p in ("a+", "b+", "c+"))
    g1 = comp.compile(s1)
    comp.compile(s2)
    assert comp.compile(s1) is g1  # s1 is now the most recent
    comp.compile(s3)  # evicts s2
    assert comp.compile(s1) is g1
    g2 = comp.compile(s2)
    assert comp.compile(s2) is g2 and comp.compile(s3) is not None
    assert comp.compile(s1) is not g1  # evicted by s3 and s2's recompile


# ---------------------------------------------------------------------- bad specs
@pytest.mark.parametrize(("kind", "value", "message"), [
    ("json", '{"type": "foo"}', "foo"),
    ("json", '{"type": "object", "properties": {"a": {"type": "integer", '
             '"minimum": 5, "maximum": 1}}, "required": ["a"]}', ""),
    ("regex", "a(b", "unclosed group"),
    ("regex", r"(a)\1", "backreference"),
    ("grammar", "start: foo", "foo"),
    ("grammar", "root ::= (", ""),
])
def test_uncompilable_specs_raise_field_error(compiler, kind, value, message):
    with pytest.raises(FieldError) as err:
        compiler.compile(StructuredOutputSpec(kind, value))
    assert err.value.field == f"structured_outputs.{kind}"
    assert message in str(err.value) and str(err.value)


@pytest.mark.parametrize(("kind", "value", "field", "message"), [
    ("json", "{not json", "structured_outputs.json", "not valid JSON"),
    ("json", "[1, 2]", "structured_outputs.json", "object or a boolean"),
    ("json", 5, "structured_outputs.json", "must be a string"),
    ("json", " " * (MAX_SPEC_CHARS + 1), "structured_outputs.json", "exceeds"),
    ("regex", "", "structured_outputs.regex", "empty"),
    ("grammar", None, "structured_outputs.grammar", "must be a string"),
    ("json_object", "{}", "structured_outputs.json_object", "no value"),
    ("choice", (), "structured_outputs.choice", "1 to"),
    ("choice", ("a", 1), "structured_outputs.choice", "list of strings"),
    ("choice", "ab", "structured_outputs.choice", "list of strings"),
    ("choice", ("x",) * (MAX_CHOICES + 1), "structured_outputs.choice", "1 to"),
    ("choice", ("x" * MAX_SPEC_CHARS, "y"), "structured_outputs.choice", "characters"),
    ("yaml", "a: 1", "structured_outputs", "unknown kind"),
])
def test_spec_shape_is_validated(kind, value, field, message):
    with pytest.raises(FieldError, match=message) as err:
        StructuredOutputSpec(kind, value)
    assert err.value.field == field


def test_valid_specs_are_hashable_and_equal_by_value():
    a = StructuredOutputSpec("choice", ["a", "b"])
    assert a.value == ("a", "b")
    assert a == StructuredOutputSpec("choice", ("a", "b"))
    assert len({a, StructuredOutputSpec("choice", ("a", "b"))}) == 1
    assert StructuredOutputSpec("json", "true").value == "true"


def test_every_eos_id_may_end_and_special_tokens_stay_out_of_text(vocab):
    comp = GrammarCompiler(vocab.tokenizer, vocab.size, (EOS, 0))  # two end tokens
    m = comp.compile(StructuredOutputSpec("json", '{"type": "string"}')).matcher()
    feed(m, vocab.tokenizer.encode('"ab').ids, vocab.size)
    row = np.zeros(comp.words, np.int32)
    m.fill_bitmask(row)
    allowed = set(allowed_ids(row, vocab.size).tolist())
    assert len(allowed) > 40_000 and not allowed & set(range(17))  # 0-16: control tokens
    feed(m, vocab.tokenizer.encode('c"').ids, vocab.size)
    m.fill_bitmask(row)
    assert m.is_terminated() and allowed_ids(row, vocab.size).tolist() == [0, EOS]
    assert m.accept_token(0) and m.error is None
