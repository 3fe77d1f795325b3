"""Device page bookkeeping: a free list and one page table per request.

Pure host code over ints; the scheduler sees pages only through ``can_allocate``,
``allocate_for`` and ``free``. Every page id in ``[1, num_pages)`` is free, or cached
(registered in ``prefix_cache``, no reference), or in page tables (``refcount[p]`` of
them); page 0 is the null page. ``num_free_pages`` counts free and cached pages: a cached
page is taken when the free list is empty, so it is room like a free one.

OBJECT_IDS: hot loops that move page ids between lists without arithmetic read them
through ``cast(list[object], ...)``: compiled with mypyc, a ``list[int]`` element is
unboxed when read and boxed again (a new object above 256) when stored.
"""

from __future__ import annotations

from collections.abc import Sequence

from superinfer_jax.kv.events import KVEventLog
from superinfer_jax.kv.layout import NULL_PAGE
from superinfer_jax.kv.prefix_cache import PrefixCache, page_tokens


def pop_many(free: list[int], n: int, what: str = "pages") -> list[int]:
    """``n`` items off the end of the LIFO list ``free``, in the order ``n`` pops would give
    them, in one slice; MemoryError when fewer are left."""
    if n > len(free):
        raise MemoryError(f"asked for {n} {what}, {len(free)} free")
    if n <= 0:
        return []
    taken = free[-n:]
    taken.reverse()
    del free[-n:]
    return taken


class PageAllocator:
    """LIFO free list: recently freed pages are reused first (warm in cache)."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, NULL_PAGE, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    def allocate(self, n: int) -> list[int]:
        return pop_many(self._free, n)

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


class KVCacheManager:
    """Page tables of the device tier, keyed by request id. ``prefix_caching``: full pages
    are registered under their block hash and shared (``prefix_cache``)."""

    def __init__(self, num_pages: int, page_size: int, *, prefix_caching: bool = False):
        self.allocator = PageAllocator(num_pages)
        self.page_size = page_size
        self.page_tables: dict[str, list[int]] = {}
        self.refcount: list[int] = [0] * num_pages
        self.prefix_cache: PrefixCache | None = PrefixCache() if prefix_caching else None
        self._num_registered: dict[str, int] = {}  # leading pages of a table registered

    @property
    def num_free_pages(self) -> int:
        """Pages an allocation may take: free, plus cached ones with no reference."""
        cache = self.prefix_cache
        return self.allocator.num_free + (len(cache.evictable) if cache is not None else 0)

    @property
    def num_cached_pages(self) -> int:
        """Registered pages no request references (findable until reclaimed)."""
        return 0 if self.prefix_cache is None else len(self.prefix_cache.evictable)

    def pages_needed(self, req_id: str, num_tokens: int) -> int:
        """Extra pages ``req_id`` needs to hold ``num_tokens`` tokens in total."""
        have = len(self.page_tables.get(req_id, ()))
        return max(0, -(-num_tokens // self.page_size) - have)

    def can_allocate(self, req_id: str, num_tokens: int) -> bool:
        # ``pages_needed`` inlined (asked for every row of every step; no clamp needed)
        need = -(-num_tokens // self.page_size) - len(self.page_tables.get(req_id, ()))
        return need <= self.num_free_pages

    def allocate_for(self, req_id: str, num_tokens: int) -> list[int]:
        """Grow ``req_id``'s table to hold ``num_tokens``; returns the new pages."""
        table = self.page_tables.get(req_id)
        if table is not None and -(-num_tokens // self.page_size) <= len(table):
            return []
        new = self._take(self.pages_needed(req_id, num_tokens))
        self.page_tables.setdefault(req_id, []).extend(new)
        return new

    def free(self, req_id: str) -> int:
        """Drop ``req_id``'s references, tail first (cached pages stay findable)."""
        pages = self.page_tables.pop(req_id, [])
        self._num_registered.pop(req_id, None)
        self._release(pages)
        return len(pages)

    def page_table(self, req_id: str) -> list[int]:
        return self.page_tables.get(req_id, [])

    def num_used_pages(self) -> int:
        """Pages referenced by some request (a shared page counts once)."""
        return self.allocator.num_usable - self.num_free_pages


    def match_prefix(self, hashes: list[bytes], max_pages: int) -> list[int]:
        """Cached pages holding the longest prefix of ``hashes`` (none without caching)."""
        if self.prefix_cache is None or max_pages <= 0:
            return []
        return self.prefix_cache.match(hashes, max_pages)

    def can_allocate_with_prefix(self, prefix: list[int], num_tokens: int) -> bool:
        """Whether a request with no pages can take ``prefix`` and grow to ``num_tokens``
        (the cached pages of ``prefix`` stop being room once referenced)."""
        need = -(-num_tokens // self.page_size) - len(prefix)
        taken = sum(self.refcount[p] == 0 for p in prefix)
        return need <= self.num_free_pages - taken

    def take_prefix(self, req_id: str, prefix: list[int]) -> None:
        """Start ``req_id``'s table (it has none) with the shared pages ``prefix``."""
        if self.page_tables.get(req_id):
            raise RuntimeError(f"{req_id} already holds pages")
        cache = self.prefix_cache
        assert cache is not None or not prefix
        for p in prefix:
            if self.refcount[p] == 0:
                assert cache is not None
                cache.on_referenced(p)
            self.refcount[p] += 1
        self.page_tables[req_id] = list(prefix)
        self._num_registered[req_id] = len(prefix)

    def set_kv_events(self, log: KVEventLog | None) -> None:
        """Report KV events to ``log`` from now on (None: stop)."""
        if self.prefix_cache is not None:
            self.prefix_cache.events = log

    def register_full_pages(self, req_id: str, hashes: list[bytes], num_computed: int,
                            prompt: Sequence[int] = (), output: Sequence[int] = ()) -> None:
        """Make ``req_id``'s full pages findable: those whose hash is known and whose KV a
        dispatched step writes (the first ``num_computed`` tokens). ``prompt`` and
        ``output`` describe the pages to KV events, when on."""
        cache = self.prefix_cache
        if cache is None:
            return
        table = self.page_tables.get(req_id)
        if table is None:
            return
        done = self._num_registered.get(req_id, 0)
        upto = min(len(hashes), num_computed // self.page_size, len(table))
        if cache.events is None:
            cache.register_many(table[done:upto], hashes[done:upto])
        else:
            for i in range(done, upto):
                cache.register(table[i], hashes[i], hashes[i - 1] if i else None,
                               page_tokens(prompt, output, i, self.page_size)
                               if hashes[i] not in cache.pages_of else None)
        if upto > done:
            self._num_registered[req_id] = upto


    def _take(self, n: int) -> list[int]:
        """``n`` pages with one reference each: free ones first, then evicted cached ones."""
        if n > self.num_free_pages:
            raise MemoryError(f"asked for {n} pages, {self.num_free_pages} free")
        k = min(n, self.allocator.num_free)
        pages = self.allocator.allocate(k)
        if k < n:
            cache = self.prefix_cache
            assert cache is not None
            pages.extend(self._evict_many(cache, n - k))
        refcount = self.refcount
        for p in pages:
            refcount[p] = 1
        return pages

    def _evict_many(self, cache: PrefixCache, n: int) -> list[int]:
        """Reclaim ``n`` cached pages, in ``PrefixCache.evict``'s order (a hook: the
        two-tier manager drops what it keeps)."""
        return cache.evict_many(n)[0]

    def _release(self, pages: list[int]) -> list[int]:
        """Drop a reference to each of ``pages``, tail first; returns those left with none."""
        refcount, cache = self.refcount, self.prefix_cache
        if cache is None:  # nothing shared: each page is in this one table (docstring)
            for p in pages:
                refcount[p] = 0
            freed = pages[::-1]
            self.allocator._free.extend(freed)
            return freed
        unref: list[int] = []
        for p in reversed(pages):
            left = refcount[p] - 1
            refcount[p] = left
            if not left:
                unref.append(p)
        self.allocator._free.extend(cache.release_many(unref))
        return unref

    def check_invariants(self) -> None:
        """Raise AssertionError when the device page bookkeeping is inconsistent."""
        dev_owned = [d for t in self.page_tables.values() for d in t]
        dev_free = list(self.allocator._free)
        counts: dict[int, int] = {}
        for d in dev_owned:
            counts[d] = counts.get(d, 0) + 1
        for d in range(self.allocator.num_pages):
            assert self.refcount[d] == counts.get(d, 0), f"refcount of page {d}"
        for t in self.page_tables.values():
            assert len(set(t)) == len(t), "a page twice in one table"
        cache = self.prefix_cache
        cached = [] if cache is None else list(cache.evictable)
        if cache is None:
            assert len(set(dev_owned)) == len(dev_owned), "a page shared without caching"
        else:
            assert set(cache.evictable) == {p for p in cache.page_hash
                                            if self.refcount[p] == 0}, \
                "cached pages are not exactly the registered pages without a reference"
            for h, pages in cache.pages_of.items():
                assert pages and all(cache.page_hash[p] == h for p in pages), "hash index"
            assert sum(len(v) for v in cache.pages_of.values()) == len(cache.page_hash)
            assert not set(cache.page_hash) & set(dev_free), "a registered page is free"
        assert sorted(set(dev_owned) | set(dev_free) | set(cached)) == \
            list(range(1, self.allocator.num_pages)) and \
            len(dev_free) + len(cached) + len(set(dev_owned)) == self.allocator.num_usable, \
            "device pages: some page is lost, or both free and owned"
