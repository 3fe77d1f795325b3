"""Two-tier page bookkeeping: device page tables, host page tables, host shadows.

Pure host ints, extending ``KVCacheManager``. Where a request's KV lives (``Residency``):

    DEVICE --rotate_out--> ROTATING_OUT --finish_rotate_out--> HOST
    HOST --rotate_in--> ROTATING_IN --finish_rotate_in--> DEVICE

A *shadow* is a host copy of a full device page. Pages are append-only, so a shadow stays
valid until its device page is freed, and a rotate_out copies only the *dirty* pages
(normally just the tail). rotate_out frees device pages at once (the rotation engine
gathers them before the step that may reuse them: ``duplexkv.rotation``); rotate_in
reserves them at once. A page shared by several tables (prefix caching) keeps its
shadow for the others when one request leaves.

Invariants: ``check_invariants``. Host pages a copy in flight reads are never reclaimed.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from typing import cast

from superinfer_jax.kv.events import KVEventLog
from superinfer_jax.kv.host_cache import HostCache
from superinfer_jax.kv.host_tier import HostTier, ShadowTable
from superinfer_jax.kv.page_allocator import KVCacheManager
from superinfer_jax.kv.prefix_cache import PrefixCache


class Residency(enum.IntEnum):
    DEVICE = 0
    ROTATING_OUT = 1
    HOST = 2
    ROTATING_IN = 3


# as globals: an enum member looked up on its class costs several times as much
_DEVICE, _ROTATING_OUT, _HOST, _ROTATING_IN = (
    Residency.DEVICE, Residency.ROTATING_OUT, Residency.HOST, Residency.ROTATING_IN)


@dataclass
class PageMoves:
    """Copies of one request's pages: ``device_pages[i]`` <-> ``host_pages[i]``. Never
    changed, not frozen, ``__init__`` written out (``NATIVE_INIT`` in mypyc_build)."""

    req_id: str
    device_pages: tuple[int, ...]
    host_pages: tuple[int, ...]
    prefix_hit: bool = False  # a waiting request's host-tier prefix hit, not a rotation

    def __init__(self, req_id: str, device_pages: tuple[int, ...],
                 host_pages: tuple[int, ...], prefix_hit: bool = False) -> None:
        self.req_id = req_id
        self.device_pages = device_pages
        self.host_pages = host_pages
        self.prefix_hit = prefix_hit

    def __len__(self) -> int:
        return len(self.device_pages)

    def __bool__(self) -> bool:
        # mypyc tests a native object's truth without ``__len__`` (see mypyc_build)
        return len(self) > 0


class TwoTierKVManager(KVCacheManager):
    """Device and host page tables of every request, and the host shadows."""

    def __init__(self, num_pages: int, page_size: int, num_host_pages: int = 0, *,
                 prefix_caching: bool = False, host_cache_eviction: str = "lru",
                 host_cache_max_pages: int | None = None):
        super().__init__(num_pages, page_size, prefix_caching=prefix_caching)
        self.num_host_pages = num_host_pages
        self.host_cache_max_pages = num_host_pages if host_cache_max_pages is None \
            else min(host_cache_max_pages, num_host_pages)
        self.host_cache: HostCache | None = None
        if prefix_caching and self.host_cache_max_pages > 0:
            self.host_cache = HostCache(host_cache_eviction)
        self.host_tier = HostTier(num_host_pages, self.host_cache, self.host_cache_max_pages)
        self.shadow_table = ShadowTable(num_pages)
        # host-tier hits on their way in (hash -> req_id): a request needing them waits
        self.arriving: dict[bytes, str] = {}
        self._arriving_of: dict[str, list[bytes]] = {}
        # an evicted cached page without a shadow is copied to the host first (up to
        # ``spill_budget`` pages a step); the host page is the copy's until ``take_spills``
        self.spill_budget = 0
        self._spills: list[tuple[int, int, bytes]] = []  # (device page, host page, hash)
        self.host_tables: dict[str, list[int]] = {}  # HOST / ROTATING_OUT requests
        self.residency: dict[str, Residency] = {}
        self._num_full: dict[str, int] = {}  # full pages of a parked request
        # the first k device pages of r are shadowed (a lower bound): scans start there
        self._num_clean: dict[str, int] = {}

    def set_kv_events(self, log: KVEventLog | None) -> None:
        """Both tiers report KV events to ``log`` (see ``KVCacheManager.set_kv_events``)."""
        super().set_kv_events(log)
        if self.host_cache is not None:
            self.host_cache.events = log


    @property
    def num_host_free_pages(self) -> int:
        """Host pages a rotation or shadow may take: free, plus cache-only ones."""
        return self.host_tier.num_free

    @property
    def num_host_cached_pages(self) -> int:
        """Cache-only host pages and shadows of cached device pages (reclaimable)."""
        cache_only = 0 if self.host_cache is None else len(self.host_cache)
        return cache_only + self.shadow_table.num_cached()

    @property
    def num_host_unused_pages(self) -> int:
        """Host pages in use by no request: free or cached."""
        return len(self.host_tier.free) + self.num_host_cached_pages

    @property
    def shadows(self) -> dict[int, int]:
        """Device page -> host page of every shadow, oldest first (a copy)."""
        host = self.shadow_table.host
        return {d: host[d] for d in self.shadow_table.oldest_first()}

    def residency_of(self, req_id: str) -> Residency:
        return self.residency.get(req_id, _DEVICE)

    def is_resident(self, req_id: str) -> bool:
        """KV fully on the device and usable by a step."""
        return self.residency_of(req_id) == _DEVICE

    def host_table(self, req_id: str) -> list[int]:
        return self.host_tables.get(req_id, [])

    def dirty_pages(self, req_id: str) -> list[int]:
        """Device pages of ``req_id`` whose host copy is missing or stale."""
        table = self.page_table(req_id)
        host = self.shadow_table.host
        return [d for d in table[self._num_clean.get(req_id, 0):] if not host[d]]

    def num_shadowed_pages(self, req_id: str) -> int:
        """Leading device pages of ``req_id`` known to have a shadow (a lower bound)."""
        return self._num_clean.get(req_id, 0)

    def rotation_cost_out(self, req_id: str) -> int:
        """Pages a rotate_out of ``req_id`` would copy (the rest are shadowed already)."""
        return len(self.dirty_pages(req_id))

    def rotation_cost_in(self, req_id: str) -> int:
        return len(self.host_table(req_id))

    def can_rotate_out(self, req_id: str) -> bool:
        """Resident, holds pages, and the host tier has room (reclaiming others' shadows)."""
        return self._out_cost(req_id) is not None

    def _out_cost(self, req_id: str) -> int | None:
        """``rotation_cost_out`` when ``can_rotate_out``, else None (one pass for both)."""
        table = self.page_table(req_id)
        if not self.is_resident(req_id) or not table:
            return None
        cost = self.rotation_cost_out(req_id)
        short = cost - self.num_host_free_pages
        return cost if short <= 0 or len(self._reclaim(table, short)) == short else None

    def can_rotate_in(self, req_id: str) -> bool:
        return (self.residency_of(req_id) == _HOST
                and self.rotation_cost_in(req_id) <= self.num_free_pages)


    def allocate_for(self, req_id: str, num_tokens: int) -> list[int]:
        state = self.residency.get(req_id)  # ``is_resident`` inlined: called every row
        if state is not None and state != _DEVICE:
            raise RuntimeError(f"{req_id} is {state.name}, not on device")
        return super().allocate_for(req_id, num_tokens)

    def free(self, req_id: str) -> int:
        """Free every page of ``req_id`` in both tiers. A shadow stays with a page others
        share, or, owned by nobody, with a page cached on the device when the host tier
        caches too (evicted later, it stays findable on the host)."""
        table = self.page_tables.get(req_id, [])
        host, owner, refcount = self.shadow_table.host, self.shadow_table.owner, self.refcount
        host_ids = cast(list[object], host)  # ids as objects (``OBJECT_IDS``)
        shadowed = [i for i in range(len(table)) if host[table[i]]]  # positions in table
        registered = self.prefix_cache.page_hash if self.prefix_cache is not None else {}
        keep = self.host_cache is not None
        dropped: list[object] = []
        for i in shadowed:
            d = table[i]
            if refcount[d] != 1:
                continue
            if keep and d in registered:
                owner[d] = None
            else:
                dropped.append(host_ids[d])
                host[d] = 0
        self.host_tier.release(cast(list[int], dropped))  # one batch: the same free order
        orphans = {d for d in (table[i] for i in shadowed)
                   if refcount[d] > 1 and owner[d] == req_id}
        if orphans:  # each goes to the first other table holding it: one pass over them
            for r, t in self.page_tables.items():
                taken = orphans.intersection(t) if r != req_id else None
                if taken:
                    for d in taken:
                        owner[d] = r
                    orphans -= taken
                    if not orphans:
                        break
        self._num_clean.pop(req_id, None)
        self.host_tier.release(self.host_tables.pop(req_id, []))
        self._forget_arriving(req_id)
        self.residency.pop(req_id, None)
        self._num_full.pop(req_id, None)
        return super().free(req_id)


    def rotate_out(self, req_id: str, num_computed_tokens: int) -> PageMoves:
        """Park ``req_id`` on the host: frees its device pages now; returns the copies of
        its dirty pages, to issue before any later step is dispatched."""
        moves = self.try_rotate_out(req_id, num_computed_tokens)
        if moves is None:
            raise RuntimeError(f"cannot rotate out {req_id}")
        return moves

    def try_rotate_out(self, req_id: str, num_computed_tokens: int) -> PageMoves | None:
        """``rotate_out`` if ``can_rotate_out``, else None (one look at the page table)."""
        cost = self._out_cost(req_id)
        if cost is None:
            return None
        tier = self.host_tier
        short = tier.free_cache(cost)
        for d in self._reclaim(self.page_table(req_id), short):
            tier.release([self._drop_shadow(d)])
        table = self.page_tables.pop(req_id)
        self._num_clean.pop(req_id, None)
        self._num_registered.pop(req_id, None)
        moves_dev: list[int] = []
        moves_host: list[int] = []
        # shadows become the host table in one pass, dirty pages (0) get fresh host pages
        shadow_host, refcount = cast(list[object], self.shadow_table.host), self.refcount
        pages = cast(list[object], table)
        hosts = [shadow_host[d] for d in table]  # 0: dirty
        for d in table:
            shadow_host[d] = 0
        if self.prefix_cache is not None:  # else every page has one reference
            # the others sharing a shadowed page lose its shadow: one pass
            shared = {table[i] for i in range(len(table)) if hosts[i] and refcount[table[i]] > 1}
            if shared:
                self._forget_clean(shared)
        dirty = [i for i in range(len(hosts)) if not hosts[i]]
        if dirty:
            moves_dev = cast(list[int], [pages[i] for i in dirty])
            moves_host = tier.take(len(dirty))
            fresh = cast(list[object], moves_host)
            for j in range(len(dirty)):  # indexed: a zip with ``strict`` is a generic call
                hosts[dirty[j]] = fresh[j]
        host_table = cast(list[int], hosts)
        self._release(table)  # shared pages stay with the others; the rest are cached
        self.host_tables[req_id] = host_table
        self._num_full[req_id] = min(num_computed_tokens // self.page_size, len(table))
        self.residency[req_id] = _ROTATING_OUT
        return PageMoves(req_id, tuple(moves_dev), tuple(moves_host))

    def finish_rotate_out(self, req_id: str) -> None:
        self._expect(req_id, _ROTATING_OUT)
        self.residency[req_id] = _HOST

    def rotate_in(self, req_id: str) -> PageMoves:
        """Bring ``req_id`` back: reserves device pages now; returns every page to copy.
        Full pages' host copies stay as shadows; the tail's is freed once they land."""
        if not self.can_rotate_in(req_id):
            raise RuntimeError(f"cannot rotate in {req_id}")
        host_table = self.host_tables.pop(req_id)
        device = self._take(len(host_table))  # pages of its own, never shared ones
        self.page_tables[req_id] = device
        num_full = self._num_full.pop(req_id)
        self.shadow_table.add(device[:num_full], host_table[:num_full], req_id)
        self._num_clean[req_id] = num_full
        self.host_tables[req_id] = host_table[num_full:]  # the tail, freed on arrival
        self.residency[req_id] = _ROTATING_IN
        return PageMoves(req_id, tuple(device), tuple(host_table))

    def finish_rotate_in(self, req_id: str) -> None:
        self._expect(req_id, _ROTATING_IN)
        self.host_tier.release(self.host_tables.pop(req_id))
        del self.residency[req_id]  # back to the default, DEVICE
        self._forget_arriving(req_id)

    def _forget_arriving(self, req_id: str) -> None:
        for h in self._arriving_of.pop(req_id, ()):
            if self.arriving.get(h) == req_id:
                del self.arriving[h]


    def plan_shadows(self, num_computed: dict[str, int], max_pages: int) -> list[PageMoves]:
        """Host copies for full, unshadowed pages of resident requests (eager shadowing).
        ``num_computed``: req_id -> tokens whose KV is in the pool the copy reads. Takes
        free host pages, then cache-only ones; never drops another request's shadow."""
        out: list[PageMoves] = []
        shadow_host, clean = self.shadow_table.host, self._num_clean
        page_size = self.page_size
        room = self.num_host_free_pages  # changes only where pages are taken below
        if max_pages <= 0 or not room:
            return out
        due = [(q, c) for q, c in num_computed.items() if c // page_size > clean.get(q, 0)]
        residency, tier = self.residency, self.host_tier
        for req_id, n in due:
            start = clean.get(req_id, 0)
            table = self.page_tables.get(req_id)
            if table is None or residency.get(req_id, _DEVICE) != _DEVICE:  # not resident
                continue
            num_full = min(n // page_size, len(table))
            if start >= num_full:
                continue
            dirty = [i for i in range(start, num_full) if not shadow_host[table[i]]]
            take = min(len(dirty), max_pages, room)
            clean[req_id] = dirty[take] if take < len(dirty) else num_full
            if not take:
                continue
            pages = cast(list[object], table)  # ids as objects (``OBJECT_IDS``)
            dev = cast(list[int], [pages[i] for i in dirty[:take]])
            tier.free_cache(take)
            host = tier.take(take)
            self.shadow_table.add(dev, host, req_id)
            out.append(PageMoves(req_id, tuple(dev), tuple(host)))
            max_pages -= take
            room = self.num_host_free_pages
            if max_pages <= 0 or not room:
                break
        return out

    def take_spills(self) -> PageMoves | None:
        """Copies of the pages spilled since the last call, to issue with the shadows."""
        if not self._spills:
            return None
        spills, self._spills = self._spills, []
        for _, host, h in spills:  # a hash spilled twice (two device copies): one is kept
            self.host_tier.cache_page(host, h)
        return PageMoves("", tuple(d for d, _, _ in spills), tuple(h for _, h, _ in spills))

    def drop_shadows(self, host_pages: list[int]) -> None:
        """Forget shadows whose copy failed, in the host cache too (never served)."""
        gone = set(host_pages)
        shadow_host, tier = self.shadow_table.host, self.host_tier
        for d in self.shadow_table.oldest_first():
            if shadow_host[d] in gone:
                tier.release([self._drop_shadow(d)])
        cache = self.host_cache
        if cache is not None:
            for h in gone:
                if h in cache.hash_of:
                    cache.discard(h)
                    tier.release([h])


    def take_prefix(self, req_id: str, prefix: list[int]) -> None:
        """Device hit: as the base class; a cached page's shadow gets ``req_id`` as owner."""
        super().take_prefix(req_id, prefix)
        host, owner = self.shadow_table.host, self.shadow_table.owner
        for p in prefix:
            if host[p] and owner[p] is None:
                owner[p] = req_id

    def match_host_prefix(self, hashes: list[bytes], start: int, max_pages: int) -> list[int]:
        """Cache-only host pages holding ``hashes[start:max_pages]``'s longest prefix."""
        cache = self.host_cache
        if cache is None or start >= max_pages or not cache.page_of:
            return []
        return cache.match(hashes[start:max_pages])

    def take_host_prefix(self, req_id: str, prefix: list[int], host_pages: list[int],
                         num_tokens: int) -> PageMoves:
        """Host hit: ``req_id``'s table takes the shared pages ``prefix`` and fresh pages
        for ``host_pages`` and its first chunk; returns the copies that bring the hit in.
        ROTATING_IN until they land; the host pages become the new pages' shadows."""
        cache = self.host_cache
        assert cache is not None and host_pages
        num_tokens = max(num_tokens, (len(prefix) + len(host_pages)) * self.page_size)
        if not self.can_allocate_with_prefix(prefix, num_tokens):
            raise RuntimeError(f"no device room for {req_id}'s host hit")
        self.take_prefix(req_id, prefix)
        hashes = [cache.take(h) for h in host_pages]  # out of the cache first: the
        # allocation below may insert evicted device pages' shadows and evict others
        self._arriving_of[req_id] = hashes
        self.arriving.update(dict.fromkeys(hashes, req_id))
        new = self._take(self.pages_needed(req_id, num_tokens))
        self.page_tables[req_id].extend(new)
        device = new[:len(host_pages)]
        self.shadow_table.add(device, host_pages, req_id)
        self.host_tables[req_id] = []  # no tail page to free on arrival
        self.residency[req_id] = _ROTATING_IN
        cache.hits += len(host_pages) * self.page_size
        return PageMoves(req_id, tuple(device), tuple(host_pages), prefix_hit=True)

    def take_freed_host_pages(self) -> list[int]:
        """Host pages freed since the last call: their arrays can be dropped."""
        return self.host_tier.take_freed()


    def _reclaimable(self, keep: set[int]) -> Iterator[int]:
        """Device pages whose shadow may be dropped for room, oldest first: cached pages
        first, then DEVICE requests' pages outside ``keep`` (never ROTATING_IN ones)."""
        owner = self.shadow_table.owner
        shadowed = self.shadow_table.oldest_first()
        yield from (d for d in shadowed if owner[d] is None)
        arriving = {d for r, state in self.residency.items()
                    if state == _ROTATING_IN for d in self.page_tables[r]}
        yield from (d for d in shadowed
                    if owner[d] is not None and d not in keep and d not in arriving)

    def _evict_many(self, cache: PrefixCache, n: int) -> list[int]:
        """The device reclaims ``n`` cached pages (``PrefixCache.evict_many``), then each
        goes to the host tier in that order (``_shelve``). Page by page while KV events
        are on, so that the two tiers' events interleave as the pages go."""
        hc = self.host_cache
        if cache.events is not None or (hc is not None and hc.events is not None):
            return [self._evict_one(cache) for _ in range(n)]
        pages, hashes = cache.evict_many(n)
        self._shelve(pages, hashes)
        return pages

    def _evict_one(self, cache: PrefixCache) -> int:
        page = cache.victim()
        h = cache.page_hash[page]
        cache.evict()
        self._shelve([page], [h])
        return page

    def _shelve(self, pages: list[int], hashes: list[bytes]) -> None:
        """Evicted device pages, in order (``hashes[i]``: the hash of ``pages[i]``): a
        page's shadow, if any, becomes a cache-only host page under its hash; without
        one, the page may spill (``spill_budget``)."""
        shadow_host, hc, tier = self.shadow_table.host, self.host_cache, self.host_tier
        free = tier.free
        for i in range(len(pages)):
            page = pages[i]
            host = shadow_host[page]
            if host:
                shadow_host[page] = 0
                tier.cache_page(host, hashes[i])
            elif hc is not None and self.spill_budget > 0 and hashes[i] not in hc.page_of:
                if not free:  # ``free_cache(1)`` inlined: one cache-only page made free
                    if not hc.hash_of:
                        continue
                    made = hc.evict()
                    free.append(made)
                    tier.freed.append(made)
                self.spill_budget -= 1
                self._spills.append((page, free.pop(), hashes[i]))

    def _reclaim(self, table: list[int], short: int) -> list[int]:
        """At most ``short`` pages of ``_reclaimable`` outside ``table``, as a list."""
        if short <= 0:
            return []
        return list(islice(self._reclaimable(keep=set(table)), short))

    def _drop_shadow(self, device_page: int) -> int:
        """Forget one shadow (its holders' scans restart at 0); returns its host page."""
        host = self.shadow_table.host[device_page]
        if not host:
            raise KeyError(f"device page {device_page} has no shadow")
        owner = self.shadow_table.owner[device_page]
        if owner is not None:
            self._num_clean.pop(owner, None)
        if self.refcount[device_page] > 1:
            self._forget_clean({device_page})
        self.shadow_table.host[device_page] = 0
        return host

    def _forget_clean(self, device_pages: set[int]) -> None:
        """The holders of any of ``device_pages`` lose their shadowed-prefix bound (their
        scans restart at 0): a pass over the requests that have one, not every table."""
        clean, tables = self._num_clean, self.page_tables
        for r in [r for r in clean if not device_pages.isdisjoint(tables[r])]:
            del clean[r]

    def _expect(self, req_id: str, state: Residency) -> None:
        if self.residency_of(req_id) != state:
            raise RuntimeError(
                f"{req_id} is {self.residency_of(req_id).name}, expected {state.name}")

    def check_invariants(self) -> None:
        """Raise AssertionError when the page bookkeeping of either tier is inconsistent."""
        super().check_invariants()
        host_cached = [] if self.host_cache is None else list(self.host_cache.hash_of)
        shadows = self.shadows
        host_owned = list(shadows.values()) + [h for t in self.host_tables.values()
                                                    for h in t] + [h for _, h, _ in self._spills]
        assert sorted(host_owned + list(self.host_tier.free) + host_cached) == \
            list(range(1, self.num_host_pages + 1)), "host pages: lost or owned twice"
        if self.host_cache is not None:
            self.host_cache.check_invariants()
            assert len(self.host_cache) <= self.host_cache_max_pages, "host cache over its cap"
        cached: set[int] = set() if self.prefix_cache is None else set(self.prefix_cache.evictable)
        self.shadow_table.check_invariants(
            {d for t in self.page_tables.values() for d in t}, cached, self.page_tables)
        for r, k in self._num_clean.items():
            assert all(d in shadows for d in self.page_tables[r][:k]), f"{r} clean prefix"
        for req_id, state in self.residency.items():
            parked = state in (Residency.ROTATING_OUT, Residency.HOST)
            assert (req_id in self.page_tables) == (not parked), f"{req_id} {state.name}"
            assert (req_id in self.host_tables) == (state != Residency.DEVICE), req_id
            assert (req_id in self._num_full) == parked, f"{req_id} parked bookkeeping"
        assert set(self.host_tables) <= set(self.residency), "host table of a DEVICE request"
        for h, r in self.arriving.items():
            assert self.residency_of(r) == Residency.ROTATING_IN, f"{r} arrived, still listed"
            assert h in self._arriving_of[r]
