"""Batched eviction reclaims the pages, in the order, that page-by-page eviction does.

``TwoTierKVManager`` evicts cached device pages one by one while KV events are on (so the
two tiers' events interleave as pages go) and in one pass over the LRU otherwise. Two
managers, one with events and one without, take the same random traffic (shared prefixes,
waiting requests' wanted pages, rotations, eager shadows, host-tier hits, floods that
spill) and must agree on every page id, every order and every counter after each action.
The host cache's two eviction orders are checked against a plain list model.
"""

from __future__ import annotations

import random

import pytest

from superinfer_jax.kv.events import KVEventLog
from superinfer_jax.kv.host_cache import HostCache
from superinfer_jax.kv.prefix_cache import extend_block_hashes, isolation_key
from superinfer_jax.kv.two_tier import TwoTierKVManager

PAGE = 4
KEY = isolation_key("test-model", None)
STEMS = ([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3], [1, 2, 3, 4, 7, 7, 7, 7, 8, 8],
         [5] * 16, [9, 8, 7, 6, 5, 4, 3, 2])


def state(kv: TwoTierKVManager) -> tuple:
    """Everything the bookkeeping holds, orders included."""
    c, hc, tier, sh = kv.prefix_cache, kv.host_cache, kv.host_tier, kv.shadow_table
    assert c is not None and hc is not None
    host_order = sorted((s, p) for p, s in hc._seq_of.items()) if hc.policy == "fifo" \
        else list(hc._order)
    return (kv.page_tables, list(kv.refcount), list(kv.allocator._free),
            list(c.evictable), list(c.loose), dict(c.page_hash),
            {h: list(p) for h, p in c.pages_of.items()}, dict(c.wanted), c.evictions,
            dict(hc.hash_of), host_order, hc.evictions, list(tier.free), list(tier.freed),
            list(sh.host), list(sh.owner), list(kv._spills), kv.spill_budget,
            kv.host_tables, dict(kv.residency), dict(kv._num_clean), dict(kv.arriving))


class Traffic:
    """Random actions on a list of managers, each checked to answer alike."""

    def __init__(self, seed: int, managers: list[TwoTierKVManager]):
        self.rng = random.Random(seed)
        self.kvs = managers
        self.tokens: dict[str, list[int]] = {}
        self.hashes: dict[str, list[bytes]] = {}
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.parked: list[str] = []
        self.n = 0

    def each(self, fn):
        out = [fn(kv) for kv in self.kvs]
        assert all(o == out[0] for o in out), f"managers answered {out}"
        return out[0]

    def arrive(self) -> None:
        r = f"r{self.n}"
        self.n += 1
        stem = self.rng.choice(STEMS)
        toks = stem[:self.rng.randint(1, len(stem))] + [self.rng.randint(10, 12)
                                                         for _ in range(self.rng.randint(0, 9))]
        self.tokens[r], self.hashes[r] = toks, []
        extend_block_hashes(self.hashes[r], toks, (), PAGE, KEY)
        self.each(lambda kv: kv.prefix_cache.want(self.hashes[r][:(len(toks) - 1) // PAGE]))
        self.waiting.append(r)

    def admit(self) -> None:
        r = self.rng.choice(self.waiting)
        n, hashes = len(self.tokens[r]), self.hashes[r]
        usable = (n - 1) // PAGE
        prefix = self.each(lambda kv: kv.match_prefix(hashes, usable))
        host = self.each(lambda kv: kv.match_host_prefix(hashes, len(prefix), usable))
        if not self.each(lambda kv: kv.can_allocate_with_prefix(prefix, n)):
            return
        if host:
            self.each(lambda kv: kv.take_host_prefix(r, prefix, host, n))
            self.each(lambda kv: kv.finish_rotate_in(r))
        else:
            self.each(lambda kv: kv.take_prefix(r, prefix))
            self.each(lambda kv: kv.allocate_for(r, n))
        self.each(lambda kv: kv.register_full_pages(r, hashes, n))
        self.each(lambda kv: kv.prefix_cache.unwant(hashes[:usable]))
        self.waiting.remove(r)
        self.running.append(r)

    def grow(self) -> None:
        r = self.rng.choice(self.running)
        n = len(self.tokens[r]) + self.rng.randint(1, 6)
        if not self.each(lambda kv: kv.can_allocate(r, n)):
            return
        self.each(lambda kv: kv.allocate_for(r, n))
        self.tokens[r] += [self.rng.randint(10, 12) for _ in range(n - len(self.tokens[r]))]
        extend_block_hashes(self.hashes[r], self.tokens[r], (), PAGE, KEY)
        self.each(lambda kv: kv.register_full_pages(r, self.hashes[r], n))

    def finish(self) -> None:
        group = self.rng.choice([g for g in (self.running, self.parked) if g])
        r = group.pop(self.rng.randrange(len(group)))
        self.each(lambda kv: kv.free(r))

    def rotate_out(self) -> None:
        r = self.rng.choice(self.running)
        n = len(self.tokens[r])
        if self.each(lambda kv: kv.try_rotate_out(r, n)) is None:
            return
        self.each(lambda kv: kv.finish_rotate_out(r))
        self.running.remove(r)
        self.parked.append(r)

    def rotate_in(self) -> None:
        r = self.rng.choice(self.parked)
        if not self.each(lambda kv: kv.can_rotate_in(r)):
            return
        self.each(lambda kv: kv.rotate_in(r))
        self.each(lambda kv: kv.finish_rotate_in(r))
        self.parked.remove(r)
        self.running.append(r)
        self.each(lambda kv: kv.register_full_pages(r, self.hashes[r], len(self.tokens[r])))

    def shadows(self) -> None:
        computed = {r: len(self.tokens[r]) for r in self.running}
        budget = self.rng.randint(0, 8)
        self.each(lambda kv: kv.plan_shadows(computed, budget))

    def flood(self) -> None:
        """Another tenant takes pages (evicting cached ones, some spilling) and leaves."""
        n = min(self.rng.randint(1, 40), self.kvs[0].num_free_pages)
        spill = self.rng.choice([0, 2, 99])

        def take(kv: TwoTierKVManager):
            kv.spill_budget = spill
            new = kv.allocate_for("flood", n * PAGE)
            kv.spill_budget = 0
            return new, kv.take_spills()

        if n:
            self.each(take)
            self.each(lambda kv: kv.free("flood"))

    def step(self) -> None:
        actions = [self.arrive, self.flood, self.shadows]
        if self.waiting:
            actions += [self.admit] * 3
        if self.running:
            actions += [self.grow, self.grow, self.finish, self.rotate_out]
        if self.parked:
            actions += [self.rotate_in, self.rotate_in, self.finish]
        self.rng.choice(actions)()


@pytest.mark.parametrize("eviction", ["lru", "fifo"])
def test_batched_eviction_matches_page_by_page(eviction):
    evicted = 0
    for seed in range(12):
        kvs = [TwoTierKVManager(num_pages=40, page_size=PAGE, num_host_pages=48,
                                prefix_caching=True, host_cache_eviction=eviction,
                                host_cache_max_pages=20) for _ in range(2)]
        kvs[0].set_kv_events(KVEventLog(PAGE))  # page by page
        traffic = Traffic(seed, kvs)
        for _ in range(250):
            traffic.step()
            assert state(kvs[0]) == state(kvs[1])
        kvs[1].check_invariants()
        evicted += kvs[1].prefix_cache.evictions + kvs[1].host_cache.evictions
    assert evicted > 1000  # the traffic did evict, on both tiers


def test_evict_many_is_n_evicts():
    """Loose (unwanted) pages go first in LRU order, then wanted ones, as ``evict`` does
    one call at a time; asking for more than is cached is refused."""
    kv = TwoTierKVManager(num_pages=30, page_size=PAGE, num_host_pages=0, prefix_caching=True)
    for i, stem in enumerate(STEMS):
        h: list[bytes] = []
        extend_block_hashes(h, stem, (), PAGE, KEY)
        kv.allocate_for(f"r{i}", len(stem))
        kv.register_full_pages(f"r{i}", h, len(stem))
        if i % 2:
            kv.prefix_cache.want(h[:2])
    for i in (2, 0, 3, 1):
        kv.free(f"r{i}")
    cache = kv.prefix_cache
    reference = list(cache.loose) + [p for p in cache.evictable if p not in cache.loose]
    n = len(reference)
    with pytest.raises(MemoryError):
        cache.evict_many(n + 1)
    pages, hashes = cache.evict_many(n - 1)
    assert pages == reference[:-1] and len(set(hashes)) == len(hashes)
    assert list(cache.evictable) == reference[-1:] and cache.evictions == n - 1


@pytest.mark.parametrize("policy", ["lru", "fifo"])
def test_host_cache_order_against_a_list_model(policy):
    """lru: pages leave in the order they went in (a hit takes one out, its return is
    new); fifo: in the order their hash was first stored, a returning hash included."""
    rng = random.Random(7)
    cache = HostCache(policy)
    model: list[tuple[int, bytes]] = []  # (host page, hash), the next to go first
    first: dict[bytes, int] = {}  # fifo: when a hash was first stored
    free = list(range(1, 30))
    clock = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.5 and free:
            h = bytes([rng.randint(0, 40)])
            page = free.pop(rng.randrange(len(free)))
            stored = cache.insert(page, h)
            assert stored == all(x != h for _, x in model)
            if not stored:
                free.append(page)
                continue
            clock += 1
            first.setdefault(h, clock)
            model.append((page, h))
            if policy == "fifo":
                model.sort(key=lambda e: first[e[1]])
        elif op < 0.75 and model:
            page, h = model.pop(rng.randrange(len(model)))
            assert cache.take(page) == h
            free.append(page)
        elif model:
            page, h = model.pop(0)
            assert cache.evict() == page
            free.append(page)
            first.pop(h, None)
        assert sorted(cache.hash_of.items()) == sorted(model)
    cache.check_invariants()


def test_a_freed_owners_shared_shadows_go_to_the_first_other_holder():
    """Shadows of pages others share pass, each, to the first other table (in table
    order) that holds the page; pages only the leaver held lose theirs."""
    kv = TwoTierKVManager(num_pages=20, page_size=PAGE, num_host_pages=20, prefix_caching=True)
    toks = list(range(1, 13))  # three full pages
    h: list[bytes] = []
    extend_block_hashes(h, toks, (), PAGE, KEY)
    kv.allocate_for("a", 12)
    kv.register_full_pages("a", h, 12)
    kv.plan_shadows({"a": 12}, 8)  # a owns the three shadows
    pa = kv.page_table("a")
    kv.take_prefix("b", pa[:1])  # b shares page 0, c pages 0 and 1, d page 0 and 1
    kv.take_prefix("c", pa[:2])
    kv.take_prefix("d", pa[:2])
    kv.free("a")
    owner = kv.shadow_table.owner
    assert (owner[pa[0]], owner[pa[1]]) == ("b", "c")
    assert owner[pa[2]] is None and kv.shadow_table.host[pa[2]]  # cached, shadow kept
    kv.check_invariants()
