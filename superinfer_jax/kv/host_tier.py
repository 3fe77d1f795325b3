"""The host side of ``two_tier.TwoTierKVManager``: host page ids and device pages' shadows."""

from __future__ import annotations

from typing import cast

from superinfer_jax.kv.host_cache import HostCache
from superinfer_jax.kv.page_allocator import pop_many


class HostTier:
    """Host page ids ``1..num_pages``: the free ones (LIFO) and the cache-only ones (at
    most ``max_cache_pages``); pages a request owns are in neither."""

    def __init__(self, num_pages: int, cache: HostCache | None, max_cache_pages: int):
        self.num_pages = num_pages
        self.cache = cache
        self.max_cache_pages = max_cache_pages
        self.free: list[int] = list(range(num_pages, 0, -1))
        self.freed: list[int] = []  # since the last ``take_freed``

    @property
    def num_free(self) -> int:
        """Host pages a rotation or shadow may take: free, plus cache-only ones."""
        cache = self.cache
        return len(self.free) + (len(cache) if cache is not None else 0)

    def take(self, n: int) -> list[int]:
        """``n`` free host pages, as ``n`` pops of the free list (the caller checked)."""
        return pop_many(self.free, n, "host pages")

    def release(self, pages: list[int]) -> None:
        self.free.extend(reversed(pages))
        self.freed.extend(pages)

    def take_freed(self) -> list[int]:
        """Host pages freed since the last call: their arrays can be dropped."""
        out, self.freed = self.freed, []
        return out

    def free_cache(self, need: int) -> int:
        """Evict cache-only pages until ``need`` are free; returns how many are missing."""
        cache, free = self.cache, self.free
        if cache is not None and len(free) < need:
            cached, freed = cache.hash_of, self.freed  # ``release`` of one page, inlined
            while len(free) < need and cached:
                page = cache.evict()
                free.append(page)
                freed.append(page)
        return need - len(free)

    def cache_page(self, host: int, h: bytes) -> None:
        """``host`` becomes a cache-only page under ``h`` (freed without a cache, or when
        ``h`` is cached already)."""
        cache, free, freed = self.cache, self.free, self.freed  # ``release``s inlined
        if cache is None or h in cache.page_of:
            free.append(host)
            freed.append(host)
            return
        cached, cap = cache.hash_of, self.max_cache_pages
        while len(cached) >= cap:
            page = cache.evict()
            free.append(page)
            freed.append(page)
        cache.insert(host, h)


class ShadowTable:
    """Shadows, in lists indexed by device page (a rotation moves tens of pages): ``host``
    (0: none), ``owner`` (None: a cached page's), and age as ``batch`` (one int object
    per ``add``, stored as ``object`` so mypyc does not box it per page) and ``pos``."""

    def __init__(self, num_pages: int):
        self.host: list[int] = [0] * num_pages
        self.owner: list[str | None] = [None] * num_pages
        self.batch: list[object] = [0] * num_pages
        self.pos: list[int] = [0] * num_pages
        self.num_batches = 0

    def add(self, device_pages: list[int], host_pages: list[int], owner: str) -> None:
        """``host_pages`` become the shadows of ``device_pages``, owned by ``owner``."""
        if len(device_pages) != len(host_pages):
            raise ValueError(f"{len(device_pages)} device pages, {len(host_pages)} host")
        shadow_host, shadow_owner, shadow_batch, shadow_pos = cast(
            list[object], self.host), self.owner, self.batch, self.pos
        hosts = cast(list[object], host_pages)  # ids as objects (``OBJECT_IDS``)
        batch: object = self.num_batches
        self.num_batches += 1
        for i in range(len(device_pages)):  # indexed: mypyc runs a zip generically
            d = device_pages[i]
            shadow_host[d] = hosts[i]
            shadow_owner[d] = owner
            shadow_batch[d] = batch
            shadow_pos[d] = i

    def pages(self) -> list[int]:
        """Device pages with a shadow, by page id (a pass over the device pages)."""
        host = self.host
        return [d for d in range(len(host)) if host[d]]

    def oldest_first(self) -> list[int]:
        """Device pages with a shadow, the oldest shadow first."""
        batch, pos = self.batch, self.pos
        return sorted(self.pages(), key=lambda d: (cast(int, batch[d]), pos[d]))

    def num_cached(self) -> int:
        """Shadows of cached device pages (owned by nobody)."""
        owner = self.owner
        return sum(owner[d] is None for d in self.pages())

    def check_invariants(self, owned: set[int], cached: set[int],
                         page_tables: dict[str, list[int]]) -> None:
        shadows = self.pages()
        assert set(shadows) <= owned | cached, "a shadow of a free device page"
        assert len({(self.batch[d], self.pos[d]) for d in shadows}) == len(shadows), \
            "two shadows made at once"
        for d in shadows:
            r = self.owner[d]
            if r is None:
                assert d in cached, f"unowned shadow of {d}, not a cached page"
            else:
                assert d in page_tables.get(r, ()), f"shadow of {d} owned by {r}, not its table"
