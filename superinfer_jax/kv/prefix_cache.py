"""Automatic prefix caching, device tier: content-addressed full pages.

A full page's *block hash* chains its parent page's hash, its token ids and the
request's isolation key (model and ``cache_salt``): pages with one hash hold the same KV
and are interchangeable. Hashes are blake2b (stable across processes), computed
incrementally (``extend_block_hashes``).

``PrefixCache`` keeps what is findable (reference counts live in ``KVCacheManager``):
- a full page whose KV is written is *registered* under its hash; at reference count 0 it
  stays cached in ``evictable`` and is reclaimed only when the free list is empty;
- pages are released tail first (as in vLLM V1), so a chain's child is evicted before its
  parent: the registered hashes stay *prefix-closed* and ``match`` finds no holes;
- one hash may be registered for several pages (two requests computed one prompt);
- a partial tail page is never registered, so never shared;
- *wanted* hashes (``want``: prompt pages of requests waiting for their first admission)
  are reclaimed only when no other cached page is left: the queue is certain demand.
  Wanted sets are prefix-closed, so the cache stays prefix-closed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from superinfer_jax.kv.events import MEDIUM_DEVICE, KVEventLog

ROOT = b""  # parent "hash" of a request's first page (the isolation key is mixed in)
DIGEST_SIZE = 16


def isolation_key(model_identity: str, cache_salt: str | None) -> bytes:
    """What two requests must share to share pages: the model and the salt."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    h.update(model_identity.encode())
    h.update(b"\x00salt\x00" if cache_salt is not None else b"\x00nosalt\x00")
    if cache_salt is not None:
        h.update(cache_salt.encode("utf-8", "surrogatepass"))
    return h.digest()


def block_hash(parent: bytes, tokens: Sequence[int], key: bytes) -> bytes:
    """The hash of one full page: parent page's hash, this page's token ids, the key."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE, key=key[:64])
    h.update(parent)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def page_tokens(prompt: Sequence[int], output: Sequence[int], index: int,
                page_size: int) -> list[int]:
    """The token ids of full page ``index`` of ``prompt + output``."""
    start = index * page_size
    end = start + page_size
    n_prompt = len(prompt)
    if end <= n_prompt:
        return list(prompt[start:end])
    if start >= n_prompt:
        return list(output[start - n_prompt:end - n_prompt])
    return list(prompt[start:]) + list(output[:end - n_prompt])


def extend_block_hashes(hashes: list[bytes], prompt: Sequence[int], output: Sequence[int],
                        page_size: int, key: bytes) -> None:
    """Append the hashes of the full pages of ``prompt + output`` not hashed yet."""
    known = len(prompt) + len(output)
    while (len(hashes) + 1) * page_size <= known:
        tokens = page_tokens(prompt, output, len(hashes), page_size)
        hashes.append(block_hash(hashes[-1] if hashes else ROOT, tokens, key))


class PrefixCache:
    """Registered device pages by hash, and the LRU of unreferenced ones (``evictable``)."""

    def __init__(self) -> None:
        self.page_hash: dict[int, bytes] = {}  # registered page -> its hash
        self.pages_of: dict[bytes, dict[int, None]] = {}  # hash -> registered pages
        self.evictable: OrderedDict[int, None] = OrderedDict()  # refcount 0; LRU first
        # waiting requests per hash, and the evictable pages no one waits for (LRU)
        self.wanted: dict[bytes, int] = {}
        self.loose: OrderedDict[int, None] = OrderedDict()
        self.queries = 0
        self.hits = 0
        self.evictions = 0
        self.events: KVEventLog | None = None  # KV events: set by the engine when asked

    def __len__(self) -> int:
        return len(self.page_hash)

    def __bool__(self) -> bool:
        # mypyc tests a native object's truth without ``__len__`` (see mypyc_build)
        return len(self) > 0

    def register(self, page: int, h: bytes, parent: bytes | None = None,
                 token_ids: Sequence[int] | None = None) -> None:
        """``page`` holds the tokens hashed ``h`` (``parent``, ``token_ids``: for events)."""
        if page in self.page_hash:
            return
        self.page_hash[page] = h
        pages = self.pages_of.get(h)
        if pages is None:
            pages = self.pages_of[h] = {}
            if self.events is not None:
                self.events.stored(MEDIUM_DEVICE, h, parent, token_ids)
        pages[page] = None

    def register_many(self, pages: Sequence[int], hashes: Sequence[bytes]) -> None:
        """``register(pages[i], hashes[i])`` for each ``i`` in order, without KV events."""
        assert self.events is None, "KV events need register's parent and tokens"
        page_hash, pages_of = self.page_hash, self.pages_of
        for i in range(len(pages)):
            page = pages[i]
            if page in page_hash:
                continue
            h = hashes[i]
            page_hash[page] = h
            same = pages_of.get(h)
            if same is None:
                pages_of[h] = {page: None}
            else:
                same[page] = None

    def match(self, hashes: Sequence[bytes], max_pages: int) -> list[int]:
        """The longest chain of registered pages for ``hashes`` (at most ``max_pages``)."""
        out: list[int] = []
        for h in hashes[:max_pages]:
            pages = self.pages_of.get(h)
            if not pages:
                break
            out.append(next(iter(pages)))
        return out

    def on_referenced(self, page: int) -> None:
        """A cached page got a reference again (a hit): it is no longer evictable."""
        self.evictable.pop(page, None)
        self.loose.pop(page, None)

    def release_many(self, pages: Sequence[int]) -> list[int]:
        """``pages`` lost their last reference, in this order: the registered ones are
        cached (the newest in the LRU); returns the others, in order."""
        page_hash, evictable, loose, wanted = self.page_hash, self.evictable, self.loose, \
            self.wanted
        out: list[int] = []
        for page in pages:
            h = page_hash.get(page)
            if h is None:
                out.append(page)
                continue
            evictable[page] = None
            if h not in wanted:
                loose[page] = None
        return out

    def want(self, hashes: Sequence[bytes]) -> None:
        """A waiting request will look these pages up: keep them past the others."""
        wanted, loose, pages_of = self.wanted, self.loose, self.pages_of
        for h in hashes:
            n = wanted.get(h, 0)
            wanted[h] = n + 1
            if not n and h in pages_of:
                for p in pages_of[h]:
                    loose.pop(p, None)

    def unwant(self, hashes: Sequence[bytes]) -> None:
        """The request that wanted ``hashes`` left the queue: unwanted pages rejoin the LRU."""
        wanted, loose, pages_of, evictable = self.wanted, self.loose, self.pages_of, \
            self.evictable
        for h in reversed(hashes):
            n = wanted[h] - 1
            if n:
                wanted[h] = n
                continue
            del wanted[h]
            for p in pages_of.get(h, ()):
                if p in evictable:
                    loose[p] = None

    def victim(self) -> int:
        """The cached page ``evict`` takes: the LRU one nobody wants, else the LRU one."""
        return next(iter(self.loose if self.loose else self.evictable))

    def evict_many(self, n: int) -> tuple[list[int], list[bytes]]:
        """Reclaim ``n`` cached pages in one pass, the ones and the order ``n`` calls of
        ``evict`` give (the loose LRU, then the wanted LRU); returns them and their hashes."""
        if n > len(self.evictable):
            raise MemoryError(f"asked to evict {n} pages, {len(self.evictable)} cached")
        evictable, loose = self.evictable, self.loose
        m = min(n, len(loose))
        if m == len(loose):
            pages = list(loose)
            loose.clear()
        else:
            pop_loose = loose.popitem
            pages = [pop_loose(False)[0] for _ in range(m)]
        for p in pages:
            del evictable[p]
        if n > m:  # no loose page left: every cached page is wanted
            pop_evictable = evictable.popitem
            pages.extend([pop_evictable(False)[0] for _ in range(n - m)])
        page_hash, pages_of, events = self.page_hash, self.pages_of, self.events
        hashes: list[bytes] = []
        for p in pages:
            h = page_hash.pop(p)
            hashes.append(h)
            same = pages_of[h]
            del same[p]
            if not same:
                del pages_of[h]
                if events is not None:
                    events.removed(MEDIUM_DEVICE, h)
        self.evictions += n
        return pages, hashes

    def evict(self) -> int:
        """Reclaim the cached page ``victim`` names; it is forgotten."""
        page = self.victim()
        del self.evictable[page]
        self.loose.pop(page, None)
        h = self.page_hash.pop(page)
        pages = self.pages_of[h]
        del pages[page]
        if not pages:
            del self.pages_of[h]
            if self.events is not None:
                self.events.removed(MEDIUM_DEVICE, h)
        self.evictions += 1
        return page
