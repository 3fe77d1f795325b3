"""Device page bookkeeping: a free list and one page table per request.

Pure host code over ints; the scheduler sees pages only through this seam
(``can_allocate``, ``allocate_for``, ``free``), never through arrays.

Invariant: every page id in ``[1, num_pages)`` is either in the free list or in exactly
one request's page table. Page 0 is the null page and is never handed out.
"""

from __future__ import annotations

from collections import deque

from superinfer_jax.kv.layout import NULL_PAGE


class PageAllocator:
    """LIFO free list: recently freed pages are reused first (warm in cache)."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages - 1, NULL_PAGE, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} pages, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


class KVCacheManager:
    """Page tables of the device tier, keyed by request id."""

    def __init__(self, num_pages: int, page_size: int):
        self.allocator = PageAllocator(num_pages)
        self.page_size = page_size
        self.page_tables: dict[str, list[int]] = {}

    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free

    def pages_needed(self, req_id: str, num_tokens: int) -> int:
        """Extra pages ``req_id`` needs to hold ``num_tokens`` tokens in total."""
        have = len(self.page_tables.get(req_id, ()))
        return max(0, -(-num_tokens // self.page_size) - have)

    def can_allocate(self, req_id: str, num_tokens: int) -> bool:
        # ``pages_needed`` inlined: the scheduler asks this for every row of every step,
        # and the clamp at 0 changes nothing since the free count is never negative.
        need = -(-num_tokens // self.page_size) - len(self.page_tables.get(req_id, ()))
        return need <= len(self.allocator._free)

    def allocate_for(self, req_id: str, num_tokens: int) -> list[int]:
        """Grow ``req_id``'s table to hold ``num_tokens``; returns the new pages.

        Most calls are decode rows whose tail page still has room (15 of 16 tokens at
        page size 16): those return at once, without touching the free list."""
        table = self.page_tables.get(req_id)
        if table is not None and -(-num_tokens // self.page_size) <= len(table):
            return []
        new = self.allocator.allocate(self.pages_needed(req_id, num_tokens))
        self.page_tables.setdefault(req_id, []).extend(new)
        return new

    def free(self, req_id: str) -> int:
        pages = self.page_tables.pop(req_id, [])
        self.allocator.free(pages)
        return len(pages)

    def page_table(self, req_id: str) -> list[int]:
        return self.page_tables.get(req_id, [])

    def num_used_pages(self) -> int:
        return sum(len(t) for t in self.page_tables.values())
