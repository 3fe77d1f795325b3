"""The prefix cache keeps what the queue will reuse: a cached page that a request waiting
for its first admission will look up is reclaimed only after every other cached page
(``PrefixCache.want``). Scripted requests on the scheduler, no model."""

from __future__ import annotations

import pytest

from superinfer_jax.config import RotaSchedConfig
from superinfer_jax.kv.page_allocator import KVCacheManager
from superinfer_jax.request import Request
from superinfer_jax.sched.scheduler import Scheduler
from tests.superinfer_jax.sched_kit import PAGE, complete, make, req


def run_until_done(sched: Scheduler, reqs: list[Request], t: float) -> float:
    """Step the scheduler as the engine would until every one of ``reqs`` finished."""
    while any(r in sched.running or r in sched.waiting for r in reqs):
        complete(sched, sched.schedule(t), token=5)
        t += 1.0
        for r in [x for x in sched.running if len(x.output_token_ids) >= x.sampling.max_tokens]:
            sched.remove(r)
        assert t < 100, "no progress"
    return t


@pytest.mark.parametrize("policy,keep_queued", [
    ("fcfs", True), ("rotasched", True), ("fcfs", False)])
def test_a_waiting_requests_prefix_outlives_older_lru_pages(policy, keep_queued):
    """A (the older chain) and C finish and stay cached; B then needs more pages than are
    free while W, which will reuse A's prompt, waits behind it. LRU alone would reclaim
    A's pages for B (they were released first) and W would prefill them again; with the
    queue's demand known, C's pages go instead and W hits all three of A's."""
    sched, kv = make(policy, 1 + 8, prefix_caching=True, max_model_len=64, max_num_seqs=4,
                     rotasched=RotaSchedConfig(), enable_prefix_caching=True,
                     prefix_cache_keep_queued=keep_queued)
    a = req("a", range(1, 13), max_tokens=2, cached=True)  # 3 full pages, 2 tokens more
    c = req("c", range(101, 113), max_tokens=2, cached=True)
    sched.add(a)
    t = run_until_done(sched, [a], 0.0)
    sched.add(c)
    t = run_until_done(sched, [c], t)
    assert kv.num_cached_pages == 6 and kv.allocator.num_free == 2
    b = req("b", range(201, 221), max_tokens=1, cached=True)  # 5 pages: 3 must be reclaimed
    # A's 3 pages, then 1 more
    w = req("w", list(range(1, 13)) + [50, 51, 52, 53], max_tokens=2, cached=True)
    sched.add(b)
    sched.add(w)
    run_until_done(sched, [b, w], t)
    # A's chain was kept for it; without keep_queued (plain LRU) B reclaimed it
    assert w.num_cached_tokens == (12 if keep_queued else 0)
    assert b.num_cached_tokens == 0
    assert not sched.prefixes.wants and not kv.prefix_cache.wanted  # nothing left asked for


def test_wanted_pages_go_last_not_never():
    """When every cached page is wanted, an allocation still takes them (oldest first):
    the queue's demand orders reclaiming, it never blocks an allocation."""
    kv = KVCacheManager(1 + 4, PAGE, prefix_caching=True)
    cache = kv.prefix_cache
    kv.allocate_for("x", 16)
    hashes = [bytes([i]) * 16 for i in range(4)]
    kv.register_full_pages("x", hashes, 16)
    pages = list(kv.page_table("x"))
    kv.free("x")  # tail first: the last page is the oldest
    cache.want(hashes[:2])
    assert list(cache.loose) == [pages[3], pages[2]]
    kv.allocate_for("y", 16)  # all four, unwanted ones first
    assert kv.page_table("y") == [pages[3], pages[2], pages[1], pages[0]]
    cache.unwant(hashes[:2])
    assert not cache.wanted and not cache.loose
