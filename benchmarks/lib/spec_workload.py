"""The input-grounded workload of ``benchmarks.speculative``: prompts whose answer draws
on the prompt, built with seed 0 from ShareGPT replies and committed as JSONL
(``benchmarks/data/speculative_grounded.jsonl``), so every run reads the same 64 prompts.

A third ask to repeat a passage, a third to edit it (one named change), a third to quote
from it. Passages are ShareGPT assistant replies of 60 to 160 words, cut at a sentence
end where one is near. Also the plain chat workload: ShareGPT first turns, same seed.
"""

from __future__ import annotations

import json
import os
import random

from superinfer_jax.sim.sharegpt import conversation_turns, load_conversations

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data",
                    "speculative_grounded.jsonl")
KINDS = ("repeat", "edit", "quote")
EDITS = ("Replace every occurrence of the word \"the\" with \"THE\".",
         "Write every number out in words.",
         "Change the passage to the past tense.",
         "Put each sentence on its own line.")
TEMPLATES = {
    "repeat": "Repeat the following passage exactly, word for word:\n\n{passage}",
    "edit": "Edit the following passage. {edit} Keep everything else unchanged.\n\n{passage}",
    "quote": "Here is a passage:\n\n{passage}\n\nQuote its {which} sentences verbatim, "
             "in quotation marks.",
}


def _passages(rng: random.Random, n: int, limit: int = 4000) -> list[str]:
    convs, _ = load_conversations(limit=limit)
    replies = [reply for rec in convs for _, reply in conversation_turns(rec)[:1]]
    rng.shuffle(replies)
    out = []
    for text in replies:
        text = " ".join(text.split())
        words = text.split(" ")
        if len(words) < 60 or "```" in text or not text.isascii():
            continue
        cut = " ".join(words[:160])
        end = cut.rfind(". ")
        if end > len(cut) // 2:
            cut = cut[:end + 1]
        out.append(cut)
        if len(out) == n:
            break
    return out


def build(n: int = 64, seed: int = 0) -> list[dict[str, str]]:
    """``n`` prompts (``kind``, ``prompt``), the kinds in turn."""
    rng = random.Random(seed)
    rows = []
    for i, passage in enumerate(_passages(rng, n)):
        kind = KINDS[i % len(KINDS)]
        prompt = TEMPLATES[kind].format(passage=passage, edit=rng.choice(EDITS),
                                        which=rng.choice(("first two", "last two",
                                                          "first three")))
        rows.append({"kind": kind, "prompt": prompt})
    return rows


def write(path: str = DATA, n: int = 64, seed: int = 0) -> None:
    with open(path, "w") as f:
        for row in build(n, seed):
            f.write(json.dumps(row) + "\n")


def load(path: str = DATA) -> list[dict[str, str]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def chat(n: int, seed: int = 0, limit: int = 4000) -> list[dict[str, str]]:
    """``n`` plain ShareGPT first turns of at most 200 words (kind ``chat``)."""
    rng = random.Random(seed)
    convs, _ = load_conversations(limit=limit)
    firsts = [turns[0][0] for turns in map(conversation_turns, convs) if turns]
    rng.shuffle(firsts)
    keep = [t for t in firsts if 5 <= len(t.split()) <= 200 and t.isascii()]
    return [{"kind": "chat", "prompt": t} for t in keep[:n]]
