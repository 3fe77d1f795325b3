"""Automatic prefix caching, host tier: cache-only host pages, findable by block hash.

A host page enters it when the device evicts a cached page that has a host shadow: the
shadow already holds the page's KV, so the page stays findable without a copy. A hit
takes the page out: it becomes the shadow of the device page it is copied into. Pages
here are owned by nobody and are reclaimed first when the host tier needs room.
Eviction (``policy``): ``lru`` (the page that entered longest ago; a hit renews it) or
``fifo`` (the hash stored first; a hit does not renew it). ``lru`` keeps the pages in
insertion order (an ordered dict: a page goes in at the end, out from anywhere); ``fifo``
a heap of ``(seq, host page)`` with lazy deletion, since a hash stored again keeps its
first seq. With ``events`` set, inserts and removals are reported as KV events (medium
``CPU``).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence

from superinfer_jax.kv.events import MEDIUM_HOST, KVEventLog

HOST_CACHE_EVICTIONS = ("lru", "fifo")


class HostCache:
    """Hashes of cache-only host pages and their eviction order."""

    def __init__(self, policy: str = "lru"):
        if policy not in HOST_CACHE_EVICTIONS:
            raise ValueError(f"host_cache_eviction must be one of {HOST_CACHE_EVICTIONS}, "
                             f"got {policy!r}")
        self.policy = policy
        self._fifo = policy == "fifo"
        self.hash_of: dict[int, bytes] = {}  # host page -> hash
        self.page_of: dict[bytes, int] = {}  # hash -> host page (one copy per hash)
        self._order: OrderedDict[int, None] = OrderedDict()  # lru: the next to go first
        self._heap: list[tuple[int, int]] = []  # fifo: (seq, host page), lazily deleted
        self._seq_of: dict[int, int] = {}  # fifo: host page -> seq of its live heap entry
        self._first_seq: dict[bytes, int] = {}  # fifo: when a hash was first stored
        self._clock = 0
        self.hits = 0
        self.evictions = 0
        self.events: KVEventLog | None = None  # KV events: set by the engine when asked

    def __len__(self) -> int:
        return len(self.hash_of)

    def __bool__(self) -> bool:
        # mypyc tests a native object's truth without ``__len__`` (see mypyc_build)
        return len(self) > 0

    def __contains__(self, h: bytes) -> bool:
        return h in self.page_of

    def insert(self, host_page: int, h: bytes) -> bool:
        """Keep ``host_page`` findable under ``h``; False when ``h`` is here already."""
        if h in self.page_of:
            return False
        self.hash_of[host_page] = h
        self.page_of[h] = host_page
        if self._fifo:
            self._clock += 1
            seq = self._first_seq.setdefault(h, self._clock)
            self._seq_of[host_page] = seq
            heapq.heappush(self._heap, (seq, host_page))
        else:
            self._order[host_page] = None
        if self.events is not None:
            self.events.stored(MEDIUM_HOST, h)
        return True

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """Host pages holding the longest prefix of ``hashes`` found here."""
        out: list[int] = []
        page_of = self.page_of
        for h in hashes:
            page = page_of.get(h)
            if page is None:
                break
            out.append(page)
        return out

    def take(self, host_page: int) -> bytes:
        """Remove ``host_page`` for a hit; returns its hash."""
        h = self.hash_of.pop(host_page)
        del self.page_of[h]
        if self._fifo:
            del self._seq_of[host_page]
        else:
            del self._order[host_page]
        if self.events is not None:
            self.events.removed(MEDIUM_HOST, h)
        return h

    def evict(self) -> int:
        """Forget the page that goes first (see ``policy``); returns its host page."""
        if not self._fifo:
            page = self._order.popitem(False)[0]
            h = self.hash_of.pop(page)
            del self.page_of[h]
            if self.events is not None:
                self.events.removed(MEDIUM_HOST, h)
            self.evictions += 1
            return page
        heap, seq_of = self._heap, self._seq_of
        while True:
            seq, page = heapq.heappop(heap)
            if seq_of.get(page) == seq:
                break
        h = self.take(page)
        self._first_seq.pop(h, None)
        self.evictions += 1
        self._compact()
        return page

    def discard(self, host_page: int) -> None:
        """Forget ``host_page`` if it is here (its copy failed: never serve it)."""
        if host_page in self.hash_of:
            self._first_seq.pop(self.take(host_page), None)

    def _compact(self) -> None:
        """fifo: bound the lazy heap and the memory of hashes to a few times the live size."""
        live = len(self._seq_of)
        if len(self._heap) > 2 * live + 64:
            self._heap = [(s, p) for p, s in self._seq_of.items()]
            heapq.heapify(self._heap)
        if len(self._first_seq) > 4 * live + 1024:  # hashes out on hits, never back
            self._first_seq = {h: s for h, s in self._first_seq.items() if h in self.page_of}

    def check_invariants(self) -> None:
        order = self._seq_of if self._fifo else self._order
        assert len(self.page_of) == len(self.hash_of) == len(order)
        assert set(order) == set(self.hash_of), "host cache order"
        for page, h in self.hash_of.items():
            assert self.page_of[h] == page, "host cache index"
        live = {(s, p) for p, s in self._seq_of.items()}
        assert live <= set(self._heap), "a live host cache page missing from the order"
