"""The draft model's KV pages, keyed by request: which pages each request holds in the
draft's own pool and how many of its tokens they hold the KV of.

A request's tokens only ever grow, so its draft KV stays valid for as long as the pages
are kept, whatever the target does with its own pages (rotation, preemption,
recomputation): draft pages never move. What a proposal wrote past the request's tokens
(the KV of the guesses fed back into the draft) is kept as far as the guesses turn out
to be the request's next tokens (``sync`` compares them). Pages are taken for the rows of
a proposal; when the pool is short, the least recently proposed requests outside that
proposal lose theirs and are re-prefilled on their next proposal. A finished request's
pages are freed at the next proposal.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from superinfer_jax.kv.page_allocator import PageAllocator
from superinfer_jax.request import Request


@dataclass
class DraftEntry:
    req: Request
    pages: list[int] = field(default_factory=list)
    cached: int = 0  # the first tokens of the request whose KV the pages hold
    guesses: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # KV after
    last_used: int = 0


class DraftPages:
    """Page bookkeeping of the draft pool (host only); page 0 is the null page."""

    def __init__(self, num_pages: int, page_size: int):
        self.allocator = PageAllocator(num_pages)
        self.page_size = page_size
        self.entries: dict[str, DraftEntry] = {}
        self._tick = 0
        self.num_evicted = 0  # requests in flight whose pages were taken for others

    def drop_finished(self) -> None:
        for req_id in [r for r, e in self.entries.items() if e.req.status.is_finished]:
            self.drop(req_id)

    def drop(self, req_id: str) -> None:
        entry = self.entries.pop(req_id, None)
        if entry is not None:
            self.allocator.free(entry.pages)

    def clear(self) -> None:
        for req_id in list(self.entries):
            self.drop(req_id)

    def sync(self, req: Request, tokens: np.ndarray) -> int:
        """How many of ``tokens`` (the request's, all on the host) have KV in the pool:
        the ones counted before, then the guesses that came true; at most all but the
        last (the last token's logits start the proposal)."""
        self._tick += 1
        entry = self.entries.setdefault(req.req_id, DraftEntry(req))
        entry.last_used = self._tick
        guesses = entry.guesses[:max(0, tokens.shape[0] - entry.cached)]
        wrong = np.flatnonzero(tokens[entry.cached:entry.cached + guesses.shape[0]] != guesses)
        entry.cached += int(wrong[0]) if wrong.size else guesses.shape[0]
        entry.guesses = entry.guesses[:0]
        entry.cached = min(entry.cached, tokens.shape[0] - 1)
        return entry.cached

    def reserve(self, req_id: str, num_tokens: int, keep: set[str]) -> bool:
        """Pages for ``num_tokens`` of ``req_id``; frees the least recently used entries
        outside ``keep`` when short. False: the pool cannot hold them."""
        entry = self.entries[req_id]
        need = -(-num_tokens // self.page_size) - len(entry.pages)
        if need <= 0:
            return True
        victims = sorted((e.last_used, r) for r, e in self.entries.items() if r not in keep)
        while self.allocator.num_free < need and victims:
            self.drop(victims.pop(0)[1])
            self.num_evicted += 1
        if self.allocator.num_free < need:
            return False
        entry.pages += self.allocator.allocate(need)
        return True

    def written(self, req_id: str, num_tokens: int, guesses: np.ndarray) -> None:
        """The proposal wrote the KV of the request's ``num_tokens`` tokens and, after
        them, of ``guesses``."""
        entry = self.entries[req_id]
        entry.cached, entry.guesses = num_tokens, guesses.astype(np.int32)

    def page_table(self, req_id: str) -> list[int]:
        return self.entries[req_id].pages
