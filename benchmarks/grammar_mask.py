"""Grammar backends for structured outputs: llguidance against outlines-core, per step.

On SmolLM2's tokenizer (49,152 tokens, rebuilt from the embedded GGUF), for one realistic
JSON schema (an order: nested object, array of objects, enum, nullable string, numbers):

- ``setup_ms``: indexing the vocabulary, once per model (llguidance's ``LLTokenizer``;
  outlines-core's ``Vocabulary``, built here from the byte-level BPE token strings);
- ``compile_ms``: compiling the schema against it (median over repeats, cache missed on
  purpose): ``GrammarCompiler.compile`` / ``build_regex_from_schema`` + ``Index``;
- ``new_matcher_us``: a matcher for one more request from the compiled grammar;
- ``fill_*_ms``: filling the packed int32 bitmasks of a batch of 32 matchers for one step
  (``fill_first_ms``: the first step, cold; llguidance builds lexer states lazily, so its
  first steps are its slowest, while outlines-core computed every state at compile time);
- ``advance_*_ms``: advancing the same 32 matchers by one token each.

The batches of all rows are stepped in turn (interleaved), so load from other processes
falls on every backend alike. Each batch is steady, as under continuous batching: each
matcher is driven with the tokens of a valid JSON document (compact separators, so both
backends' whitespace rules accept it) followed by EOS, and is replaced by a fresh matcher
on a new document when it ends.
Before each advance, every token is checked against the mask just filled (untimed), so a
backend whose masks rejected a valid document would fail here rather than look fast.

llguidance runs twice: one ``fill_bitmask`` / ``accept_token`` per matcher, and on its
thread pool (``fill_bitmasks(parallel=True)``, one call for the batch, and
``consume_token_par`` for the advance). outlines-core is imported lazily: without it
installed its row is skipped with a message.

    python -m benchmarks.grammar_mask [--quick] [--batch 32] [--out results/grammar_mask.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks.lib.common import add_common_args, print_table, write_json
from superinfer_jax.structured import (
    GrammarCompiler,
    GrammarMatcher,
    StructuredOutputSpec,
    bitmask_words,
    fill_bitmasks,
)

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "maxLength": 24},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "email": {"type": "string"},
                "vip": {"type": "boolean"},
            },
            "required": ["name", "email", "vip"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "qty": {"type": "integer"},
                    "price": {"type": "number"},
                },
                "required": ["sku", "qty", "price"],
                "additionalProperties": False,
            },
            "minItems": 1,
        },
        "status": {"enum": ["pending", "paid", "shipped", "cancelled"]},
        "notes": {"type": ["string", "null"]},
    },
    "required": ["order_id", "customer", "items", "status", "notes"],
    "additionalProperties": False,
}

_WORDS = ("alpha", "bravo", "Ada", "Lovelace", "Grace", "Hopper", "widget", "gadget",
          "blue", "large", "deliver", "before", "noon", "fragile", "café", "Zürich")


def documents(n: int, seed: int = 0) -> list[str]:
    """Valid instances of SCHEMA, varied in length (about 60 to 200 tokens)."""
    rng = random.Random(seed)

    def words(k: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(k))

    docs = []
    for i in range(n):
        doc = {
            "order_id": f"ORD-{rng.randrange(10**8):08d}",
            "customer": {"name": words(2), "email": f"user{i}@example.com",
                         "vip": rng.random() < 0.5},
            "items": [{"sku": f"SKU-{rng.randrange(10**5)}", "qty": rng.randrange(1, 20),
                       "price": round(rng.uniform(0.5, 500), 2)}
                      for _ in range(rng.randrange(1, 6))],
            "status": rng.choice(["pending", "paid", "shipped", "cancelled"]),
            "notes": words(rng.randrange(1, 12)) if rng.random() < 0.7 else None,
        }
        docs.append(json.dumps(doc, separators=(",", ":"), ensure_ascii=False))
    return docs


def load_vocab() -> tuple[Any, tuple[int, ...], int]:
    """SmolLM2's tokenizers.Tokenizer from the embedded GGUF's metadata (no weights)."""
    from models.loaders import embedded_gguf_path
    from models.loaders.gguf_loader import _fields, open_gguf
    from models.tokenizer import Tokenizer

    path = embedded_gguf_path("smollm2-135m")
    tok = Tokenizer.from_gguf_fields(_fields(open_gguf(path), path))
    return tok.backend, tok.eos_token_ids, tok.vocab_size


# ------------------------------------------------------------------ one backend's driver
@dataclass
class Backend:
    """What the steady-batch loop needs from a backend."""

    name: str
    setup_ms: float
    compile_ms: float
    new_matcher: Callable[[], Any]
    fill: Callable[[list[Any], np.ndarray], None]
    advance: Callable[[list[Any], list[int]], list[bool]]


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


class SteadyBatch:
    """One backend's batch of ``batch`` matchers, each on its own document; ``step``
    fills the masks and advances every matcher once, replacing those that ended."""

    def __init__(self, backend: Backend, token_docs: list[list[int]], batch: int,
                 vocab_size: int):
        self.backend = backend
        self.token_docs = token_docs
        self.out = np.zeros((batch, bitmask_words(vocab_size)), np.int32)
        self.next_doc = 0
        self.new_us: list[float] = []
        self.fill_ms: list[float] = []
        self.adv_ms: list[float] = []
        self.finished = 0
        self.matchers: list[Any] = []
        self.docs: list[list[int]] = []
        self.pos: list[int] = []
        for _ in range(batch):
            m, d = self._new()
            self.matchers.append(m)
            self.docs.append(d)
            self.pos.append(0)

    def _new(self) -> tuple[Any, list[int]]:
        t = time.perf_counter()
        m = self.backend.new_matcher()
        self.new_us.append((time.perf_counter() - t) * 1e6)
        d = self.token_docs[self.next_doc % len(self.token_docs)]
        self.next_doc += 1
        return m, d

    def step(self) -> None:
        name, out = self.backend.name, self.out
        t = time.perf_counter()
        self.backend.fill(self.matchers, out)
        self.fill_ms.append((time.perf_counter() - t) * 1e3)
        tokens = [d[p] for d, p in zip(self.docs, self.pos, strict=True)]
        for i, tok in enumerate(tokens):  # untimed: the mask must allow the document
            if not (int(out[i, tok // 32]) >> (tok % 32)) & 1:
                raise RuntimeError(f"{name}: mask of row {i} rejects token {tok} "
                                   f"at position {self.pos[i]} of a valid document")
        t = time.perf_counter()
        ok = self.backend.advance(self.matchers, tokens)
        self.adv_ms.append((time.perf_counter() - t) * 1e3)
        if not all(ok):
            raise RuntimeError(f"{name}: a valid token was not accepted")
        for i in range(len(self.matchers)):
            self.pos[i] += 1
            if self.pos[i] == len(self.docs[i]):
                self.finished += 1
                self.matchers[i], self.docs[i] = self._new()
                self.pos[i] = 0

    def stats(self) -> dict[str, Any]:
        fill, adv = self.fill_ms, self.adv_ms
        return {
            "fill_mean_ms": statistics.fmean(fill),
            "fill_p50_ms": pct(fill, 50),
            "fill_p99_ms": pct(fill, 99),
            "fill_first_ms": fill[0],
            "fill_max_ms": max(fill),
            "advance_mean_ms": statistics.fmean(adv),
            "advance_p99_ms": pct(adv, 99),
            "new_matcher_us": statistics.median(self.new_us),
            "steps": len(fill),
            "documents_finished": self.finished,
        }


def run_interleaved(backends: list[Backend], token_docs: list[list[int]], batch: int,
                    steps: int, vocab_size: int) -> list[dict[str, Any]]:
    """Step every backend's batch in turn (the order rotating each step), so load from
    other processes on the machine falls on all backends alike and the ratios hold."""
    batches = [SteadyBatch(b, token_docs, batch, vocab_size) for b in backends]
    for s in range(steps):
        for k in range(len(batches)):
            batches[(s + k) % len(batches)].step()
    return [b.stats() for b in batches]


# ------------------------------------------------------------------ llguidance
def llguidance_backends(tokenizer: Any, eos: tuple[int, ...], vocab_size: int,
                        repeats: int) -> list[Backend]:
    import llguidance

    t = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, vocab_size, eos)
    setup_ms = (time.perf_counter() - t) * 1e3
    text = json.dumps(SCHEMA)
    times = []
    for r in range(repeats):  # trailing spaces: an equal schema the cache has not seen
        spec = StructuredOutputSpec("json", text + " " * (r + 1))
        t = time.perf_counter()
        compiler.compile(spec)
        times.append((time.perf_counter() - t) * 1e3)
    compile_ms = statistics.median(times)
    # One compiled grammar per row, each starting cold: llguidance builds its lexer
    # states lazily, and a row sharing the first row's would skip that warm-up.
    loop_grammar = compiler.compile(StructuredOutputSpec("json", text))
    batched_grammar = compiler.compile(StructuredOutputSpec("json", "\n" + text))
    executor = llguidance.LLExecutor()

    def fill_loop(ms: list[GrammarMatcher], out: np.ndarray) -> None:
        for i, m in enumerate(ms):
            m.fill_bitmask(out[i])

    def fill_pool(ms: list[GrammarMatcher], out: np.ndarray) -> None:
        fill_bitmasks(ms, out, parallel=True)

    def advance_loop(ms: list[GrammarMatcher], tokens: list[int]) -> list[bool]:
        return [m.accept_token(tok) for m, tok in zip(ms, tokens, strict=True)]

    def advance_par(ms: list[GrammarMatcher], tokens: list[int]) -> list[bool]:
        # The matchers' llguidance objects: measuring whether a batched accept is worth
        # adding to GrammarMatcher's API.
        return executor.consume_token_par([(m._m, tok) for m, tok in zip(ms, tokens,
                                                                         strict=True)])

    return [
        Backend("llguidance (per-matcher fill, accept)", setup_ms, compile_ms,
                loop_grammar.matcher, fill_loop, advance_loop),
        Backend("llguidance (thread pool: fill_bitmasks, consume_token_par)", setup_ms, compile_ms,
                batched_grammar.matcher, fill_pool, advance_par),
    ]


# ------------------------------------------------------------------ outlines-core
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character each byte is written as."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def outlines_backend(tokenizer: Any, eos: tuple[int, ...], vocab_size: int,
                     repeats: int) -> Backend:
    import outlines_core

    t = time.perf_counter()
    decoder = _byte_decoder()
    special = {tok.content for tok in tokenizer.get_added_tokens_decoder().values()
               if tok.special}
    vocab_map: dict[bytes, list[int]] = {}
    for token, tid in tokenizer.get_vocab(with_added_tokens=True).items():
        if tid in eos or token in special or any(c not in decoder for c in token):
            continue
        vocab_map.setdefault(bytes(decoder[c] for c in token), []).append(tid)
    vocabulary = outlines_core.Vocabulary(eos[0], vocab_map)
    setup_ms = (time.perf_counter() - t) * 1e3
    regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
    times = []
    index = None
    for _ in range(repeats):
        t = time.perf_counter()
        outlines_core.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
        index = outlines_core.Index(regex, vocabulary)
        times.append((time.perf_counter() - t) * 1e3)
    words = bitmask_words(vocab_size)

    def fill(guides: list[Any], out: np.ndarray) -> None:
        for i, g in enumerate(guides):
            g.write_mask_into(out[i].ctypes.data, words, 4)

    def advance(guides: list[Any], tokens: list[int]) -> list[bool]:
        ok = []
        for g, tok in zip(guides, tokens, strict=True):
            if tok in eos:  # a Guide has no transition on EOS: it ends in a final state
                ok.append(g.is_finished())
                continue
            g.advance(tok, return_tokens=False)  # raises on a token outside the grammar
            ok.append(True)
        return ok

    return Backend("outlines-core (per-guide fill, advance)", setup_ms,
                   statistics.median(times), lambda: outlines_core.Guide(index), fill, advance)


# ------------------------------------------------------------------ main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser, "grammar_mask")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=None,
                        help="decode steps per backend (default 150 quick, 1000 full)")
    args = parser.parse_args()
    steps = args.steps or (150 if args.quick else 1000)
    repeats = 3 if args.quick else 7

    tokenizer, eos, vocab_size = load_vocab()
    token_docs = [tokenizer.encode(d).ids + [eos[0]] for d in documents(64)]
    lengths = [len(d) for d in token_docs]
    print(f"vocab {vocab_size}, batch {args.batch}, {steps} steps, documents of "
          f"{min(lengths)}-{max(lengths)} tokens (mean {statistics.fmean(lengths):.0f}), "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")

    backends = llguidance_backends(tokenizer, eos, vocab_size, repeats)
    skipped = []
    try:
        backends.append(outlines_backend(tokenizer, eos, vocab_size, repeats))
    except ImportError as e:
        msg = f"outlines-core skipped: not installed ({e}); pip install 'outlines-core>=0.2,<0.3'"
        print(msg)
        skipped.append(msg)

    rows = [{"backend": b.name, "setup_ms": b.setup_ms, "compile_ms": b.compile_ms, **stats}
            for b, stats in zip(backends, run_interleaved(backends, token_docs, args.batch,
                                                          steps, vocab_size), strict=True)]
    print_table(rows, title=f"grammar masks, JSON schema, batch {args.batch}, "
                            f"vocab {vocab_size}")

    ratios: dict[str, float] = {}
    outlines_row = next((r for r in rows if r["backend"].startswith("outlines")), None)
    if outlines_row is not None:
        best = min((r for r in rows if r["backend"].startswith("llguidance")),
                   key=lambda r: r["fill_mean_ms"] + r["advance_mean_ms"])
        ratios = {
            "compile": outlines_row["compile_ms"] / best["compile_ms"],
            "fill_mean": outlines_row["fill_mean_ms"] / best["fill_mean_ms"],
            "fill_p99": outlines_row["fill_p99_ms"] / best["fill_p99_ms"],
            "advance_mean": outlines_row["advance_mean_ms"] / best["advance_mean_ms"],
        }
        print(f"\noutlines-core / llguidance ({best['backend']}): "
              + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    write_json(args.out, {
        "benchmark": "grammar_mask",
        "quick": args.quick,
        "batch": args.batch,
        "vocab_size": vocab_size,
        "load_average": os.getloadavg(),
        "schema": SCHEMA,
        "document_tokens": {"min": min(lengths), "max": max(lengths),
                            "mean": statistics.fmean(lengths)},
        "rows": rows,
        "ratios_outlines_over_llguidance": ratios,
        "skipped": skipped,
    })


if __name__ == "__main__":
    main()
