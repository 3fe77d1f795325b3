"""Automatic prefix caching, device tier: content-addressed full pages.

A page full of tokens gets a *block hash* chained from its parent page's hash, its own
token ids and the request's isolation key (the model identity and the request's
``cache_salt``): two pages with the same hash hold the KV of the same tokens after the
same prefix, for the same model and tenant, so they are interchangeable. Hashes are
blake2b over bytes (stable across processes, unlike ``hash``), computed incrementally:
``extend_block_hashes`` hashes only the pages that filled since the last call.

``PrefixCache`` is the device tier's bookkeeping, pure host ints (the page manager,
``KVCacheManager``, composes it):

- every device page held by a request has a reference count (the number of page tables
  it is in); a full page whose KV is written is *registered* under its hash;
- a registered page whose count drops to 0 stays cached and findable, in ``evictable``
  (least recently released first); it is reclaimed only when the free list is empty and a
  page is needed. A request releases its pages tail first (as vLLM V1 does), so within
  one chain the child is always evicted before its parent: the set of registered hashes
  stays *prefix-closed* (every registered page's parent hash is registered too), and
  ``match`` never finds a chain with a hole;
- the same hash may be registered for several pages (two requests that computed the same
  prompt at once): each copy is cached and findable, so none is lost early;
- a partial tail page is never registered, so never shared;
- *wanted* hashes (``want``): the prompt pages of requests waiting for their first
  admission. A cached page whose hash is wanted is reclaimed only once no other cached
  page is left (``loose`` holds the others, oldest release first): the queue is known
  demand, a certain hit ahead, where the least recently used unwanted page is only a
  possible one. In the offline replay of the Mooncake conversation trace a request
  waited while the 64-page prefix it was about to reuse aged out of the LRU under it
  (``benchmarks.prefix_cache``). Wanted sets are prefix-closed (a request wants its
  chain from the first page), so the cache stays prefix-closed.

With ``events`` set (a ``kv.events.KVEventLog``), a hash's first registered page and
the eviction of its last one are reported there (KV events, ``kv.events``).
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
    """Append the hashes of the full pages of ``prompt + output`` not hashed yet (only
    the new ones: a decode step that fills no page costs one comparison)."""
    known = len(prompt) + len(output)
    while (len(hashes) + 1) * page_size <= known:
        tokens = page_tokens(prompt, output, len(hashes), page_size)
        hashes.append(block_hash(hashes[-1] if hashes else ROOT, tokens, key))


class PrefixCache:
    """Hashes of registered device pages and the LRU of cached, unreferenced ones.

    Reference counts live in the page manager (``KVCacheManager.refcount``); this class
    keeps what is findable. ``evictable`` holds registered pages with no reference,
    oldest release first; ``queries`` / ``hits`` count prompt tokens looked up and found
    at admissions (vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``)."""

    def __init__(self) -> None:
        self.page_hash: dict[int, bytes] = {}  # registered page -> its hash
        self.pages_of: dict[bytes, dict[int, None]] = {}  # hash -> registered pages
        self.evictable: OrderedDict[int, None] = OrderedDict()  # refcount 0; LRU first
        # waiting requests per hash (``want``), and the evictable pages of hashes no one
        # waits for, oldest release first: the ones ``evict`` takes first
        self.wanted: dict[bytes, int] = {}
        self.loose: OrderedDict[int, None] = OrderedDict()
        self.queries = 0
        self.hits = 0
        self.evictions = 0
        self.events: KVEventLog | None = None  # KV events: set by the engine when asked

    def __len__(self) -> int:
        return len(self.page_hash)

    def __bool__(self) -> bool:
        # Explicit, because mypyc-compiled code tests a native object's truth without
        # ``__len__`` (an empty one would be true there): see superinfer_jax.mypyc_build.
        return len(self) > 0

    def register(self, page: int, h: bytes, parent: bytes | None = None,
                 token_ids: Sequence[int] | None = None) -> None:
        """``page`` (referenced, full, its KV written or being written by a dispatched
        step) holds the tokens hashed ``h``. ``parent`` (the previous page's hash, None
        for a first page) and ``token_ids`` describe it to KV events."""
        if page in self.page_hash:
            return
        self.page_hash[page] = h
        pages = self.pages_of.get(h)
        if pages is None:
            pages = self.pages_of[h] = {}
            if self.events is not None:
                self.events.stored(MEDIUM_DEVICE, h, parent, token_ids)
        pages[page] = None

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

    def on_released(self, page: int) -> bool:
        """``page`` lost its last reference: cache it (True) if registered, else it goes
        back to the free list (False)."""
        h = self.page_hash.get(page)
        if h is not None:
            self.evictable[page] = None
            if h not in self.wanted:
                self.loose[page] = None
            return True
        return False

    def want(self, hashes: Sequence[bytes]) -> None:
        """A request waiting for its first admission will look these pages up (its
        prompt's chain from the first page): keep their cached copies past the others."""
        wanted, loose, pages_of = self.wanted, self.loose, self.pages_of
        for h in hashes:
            n = wanted.get(h, 0)
            wanted[h] = n + 1
            if not n and h in pages_of:
                for p in pages_of[h]:
                    loose.pop(p, None)

    def unwant(self, hashes: Sequence[bytes]) -> None:
        """The request that ``want``-ed ``hashes`` left the queue (admitted, aborted).
        A cached page nobody waits for any more rejoins the others as the most recently
        released, tail first, so a chain's child still goes before its parent."""
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
        """The cached page ``evict`` reclaims next: the least recently released one no
        waiting request wants, else the least recently released one."""
        return next(iter(self.loose if self.loose else self.evictable))

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
