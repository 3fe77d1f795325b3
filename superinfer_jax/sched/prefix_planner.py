"""Prefix-cache planning: which cached pages a waiting request may take. A hit is looked
up once per step for the ranking and the selection (``hit``) and again at admission
(``lookup``); a request waits for pages a runner still prefills (prefill once, share).
"""

from __future__ import annotations

from superinfer_jax.config import EngineConfig
from superinfer_jax.kv.page_allocator import KVCacheManager
from superinfer_jax.kv.prefix_cache import extend_block_hashes
from superinfer_jax.kv.two_tier import TwoTierKVManager
from superinfer_jax.request import WAITING, Request
from superinfer_jax.sched.step_plan import NO_HIT, PrefixHit

__all__ = ["PrefixPlanner"]


class PrefixPlanner:
    """The scheduler's prefix-cache state: this step's hits, the pages being prefilled,
    host-tier hits in flight and the pages queued requests asked the cache to keep.
    ``running`` is the scheduler's list of runners (shared, never rebound)."""

    def __init__(self, config: EngineConfig, kv: KVCacheManager, running: list[Request]):
        self.config = config
        self.kv = kv
        self.running = running
        self.hits: dict[str, PrefixHit] = {}  # looked up by this step's ranking and selection
        # hashes of prompt pages the runners prefill this step, built at the first look-up
        self._computing: dict[bytes, None] | None = None
        # req_id -> (host tokens, counted as cached tokens); a failed copy takes them back
        self.host_hits_in_flight: dict[str, tuple[int, bool]] = {}
        self.wants: dict[str, list[bytes]] = {}  # req_id -> hashes ``PrefixCache.want``ed

    def start_step(self) -> None:
        """Forget the last step's look-ups; register the pages that filled since."""
        self.hits.clear()
        self._computing = None
        if self.kv.prefix_cache is not None:
            self.register_full_pages()

    def want(self, req: Request) -> None:
        """Ask the prefix cache to keep the pages a new request will look up (known demand)."""
        cache = self.kv.prefix_cache
        if cache is None or req.cache_key is None or req.num_computed_tokens \
                or not self.config.prefix_caching.keep_queued:
            return
        page_size = self.kv.page_size
        extend_block_hashes(req.block_hashes, req.prompt_token_ids, req.output_token_ids,
                            page_size, req.cache_key)
        hashes = req.block_hashes[:(req.num_tokens - 1) // page_size]
        if hashes:
            cache.want(hashes)
            self.wants[req.req_id] = hashes

    def unwant(self, req: Request) -> None:
        """``req`` left the queue (admitted or gone): its pages are not kept for it."""
        hashes = self.wants.pop(req.req_id, None)
        if hashes is not None and self.kv.prefix_cache is not None:
            self.kv.prefix_cache.unwant(hashes)

    def register_full_pages(self) -> None:
        """The runners' pages that filled since the last step become findable by hash (steps
        run in order); without ``prefix_cache_generated``, only prompt pages."""
        kv, page_size = self.kv, self.kv.page_size
        generated = self.config.prefix_caching.cache_generated
        for req in self.running:
            if req.cache_key is None:
                continue
            extend_block_hashes(req.block_hashes, req.prompt_token_ids, req.output_token_ids,
                                page_size, req.cache_key)
            computed = req.num_computed_tokens if generated \
                else min(req.num_computed_tokens, len(req.prompt_token_ids))
            kv.register_full_pages(req.req_id, req.block_hashes, computed,
                                   req.prompt_token_ids, req.output_token_ids)

    def hit(self, req: Request) -> PrefixHit:
        """The longest cached prefix of waiting ``req``, looked up once per step."""
        if req.status != WAITING or not self.may_hit(req):
            return NO_HIT
        hit = self.hits.get(req.req_id)
        if hit is None:
            hit = self.hits[req.req_id] = self.lookup(req)
        return hit

    def may_hit(self, req: Request) -> bool:
        """Whether ``req`` can take a cached prefix: it uses the cache, and has no pages."""
        return req.cache_key is not None and self.kv.prefix_cache is not None \
            and not req.num_computed_tokens

    def lookup(self, req: Request) -> PrefixHit:
        """Shared device pages, then cache-only host pages, up to ``req``'s last token
        (which is always computed, so the admitting step samples from real logits)."""
        kv, page_size = self.kv, self.kv.page_size
        assert req.cache_key is not None
        extend_block_hashes(req.block_hashes, req.prompt_token_ids, req.output_token_ids,
                            page_size, req.cache_key)
        max_pages = (req.num_tokens - 1) // page_size
        hashes = req.block_hashes
        device = kv.match_prefix(hashes, max_pages)
        two_tier = kv if isinstance(kv, TwoTierKVManager) else None
        host = two_tier.match_host_prefix(hashes, len(device), max_pages) \
            if two_tier is not None else []
        # the page after the hit, unless the hit ends the prompt (a simulated request's
        # hashes may stop short of its tokens); arriving if a host hit or a runner brings it
        after = hashes[len(device)] if not host and len(device) < min(max_pages, len(hashes)) \
            else None
        arriving = after is not None and (
            two_tier is not None and after in two_tier.arriving
            or after in self._computing_hashes())
        if device or host or arriving:
            return PrefixHit(tuple(device), tuple(host), arriving)
        return NO_HIT

    def _computing_hashes(self) -> dict[bytes, None]:
        """Hashes of the prompt pages the runners are prefilling (KV not computed yet)."""
        computing = self._computing
        if computing is None:
            computing = self._computing = {}
            for r in self.running:
                self.note_computing(r)
        return computing

    def note_computing(self, req: Request) -> None:
        """Add running ``req``'s prompt pages still to compute to this step's map, if built."""
        computing = self._computing
        if computing is None or req.cache_key is None:
            return
        page_size = self.kv.page_size
        full = len(req.prompt_token_ids) // page_size
        hashes = req.block_hashes
        for i in range(req.num_computed_tokens // page_size, min(full, len(hashes))):
            computing[hashes[i]] = None

    def fork_waits(self, req: Request) -> bool:
        """Whether ``req``, a sibling of an ``n > 1`` request, waits for the first choice to
        compute its prompt's full pages, to take them from the cache (prefill once, fork)."""
        parent = req.fork_of
        if parent is None or self.kv.prefix_cache is None or parent.cache_key is None \
                or parent.cache_key != req.cache_key or parent.status.is_finished:
            return False
        full = len(parent.prompt_token_ids) // self.kv.page_size * self.kv.page_size
        return parent.num_computed_tokens < full

    def count_hit(self, req: Request, device_tokens: int, hit_tokens: int) -> None:
        """vLLM's device-tier prefix-cache counters, and the request's cached tokens."""
        cache = self.kv.prefix_cache
        if cache is None or req.cache_key is None:
            return
        cache.queries += req.num_tokens
        cache.hits += device_tokens
        if req.first_scheduled_time is None:
            req.num_cached_tokens = hit_tokens

    def take_back_host_hit(self, req: Request) -> None:
        """A host-tier hit whose copy failed is not reported as one."""
        host_tokens, first = self.host_hits_in_flight.pop(req.req_id, (0, False))
        if host_tokens:
            if first:
                req.num_cached_tokens -= host_tokens
            assert isinstance(self.kv, TwoTierKVManager) and self.kv.host_cache is not None
            self.kv.host_cache.hits -= host_tokens
