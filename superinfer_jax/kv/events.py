"""KV-cache events: which full pages are findable by block hash, on which medium.

The engine's side of KV events (the serving side, ``serving.kv_events``, encodes them
in vLLM's wire format and publishes them over ZMQ; nothing here knows about either). A
consumer, such as llm-d's KV-cache indexer, replays the stream to know which prefixes
each pod holds.

What an event means (per hash and medium, not per page):

- ``BlockStored(medium)``: the hashes became findable on that medium, where they were
  not before. ``GPU``: a device page was registered in the prefix cache
  (``PrefixCache.register``) under a hash no other registered page had. ``CPU``: a
  device page's host shadow became a cache-only host page (``HostCache.insert``: the
  host tier holds one copy a hash).
- ``BlockRemoved(medium)``: the last copy of the hashes on that medium went: the device
  reclaimed the last registered page with that hash (``PrefixCache.evict``), or a
  cache-only host page was evicted, discarded (its copy failed) or taken for a host
  hit (``HostCache.take``: the page becomes the shadow of a device page, and is
  findable again on the device once it lands and is registered there).

The device may register the same hash for several pages (``PrefixCache.pages_of``);
events are published only when a hash's first copy on a medium appears and its last
goes, so a consumer that adds on stored and removes on removed holds exactly the set of
hashes findable on each medium: ``prefix_cache.pages_of`` keys (GPU) and
``host_cache.page_of`` keys (CPU).

``AllBlocksCleared`` is defined for the wire format; the engine has no cache reset, so
it never emits one.

Hashes here are our own 16-byte blake2b digests (``prefix_cache.block_hash``: chained
from the parent page's hash, keyed by the model identity and the request's
``cache_salt``); ``serving.kv_events`` says how they go on the wire. ``token_ids`` are
the page's tokens, so a consumer with its own hashing scheme can rehash the chain.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

MEDIUM_DEVICE = "GPU"  # vLLM's names for the tiers (an accelerator; host memory)
MEDIUM_HOST = "CPU"
_BIT = {MEDIUM_DEVICE: 1, MEDIUM_HOST: 2}


@dataclass
class BlockStored:
    """Full pages now findable on ``medium``; ``block_hashes`` is a chain, each hash the
    parent of the next, the first one's parent ``parent_block_hash`` (None: the first
    page of a sequence). ``token_ids`` is the pages' tokens, in order,
    ``block_size * len(block_hashes)`` of them."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    medium: str
    lora_id: int | None = None


@dataclass
class BlockRemoved:
    """The last copy on ``medium`` of each of ``block_hashes`` is gone."""

    block_hashes: list[bytes]
    medium: str


@dataclass
class AllBlocksCleared:
    """Every block on every medium is gone (never emitted by this engine: no reset)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class KVEventLog:
    """Where the caches append their events; the engine takes them once per step.

    Also remembers each present hash's parent and tokens (only while the hash is
    findable on some medium, or went in this step): the host tier stores pages by hash
    alone, and its ``BlockStored`` carries them too. Consecutive events of one kind and
    medium are merged (a stored chain, a run of removals), as vLLM batches a request's
    blocks."""

    block_size: int
    events: list[KVEvent] = field(default_factory=list)
    _media: dict[bytes, int] = field(default_factory=dict)  # hash -> bits of media
    _info: dict[bytes, tuple[bytes | None, tuple[int, ...]]] = field(default_factory=dict)
    _gone: list[bytes] = field(default_factory=list)  # absent everywhere since take()

    def stored(self, medium: str, h: bytes, parent: bytes | None = None,
               token_ids: Sequence[int] | None = None) -> None:
        """``h`` became findable on ``medium`` (callers: only its first copy there)."""
        bit = _BIT[medium]
        self._media[h] = self._media.get(h, 0) | bit
        if token_ids is not None:
            self._info[h] = (parent, tuple(token_ids))
        else:
            parent, toks = self._info.get(h, (None, ()))
            token_ids = toks
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockStored) and last.medium == medium \
                and last.block_hashes[-1] == parent:
            last.block_hashes.append(h)
            last.token_ids.extend(token_ids)
        else:
            self.events.append(BlockStored([h], parent, list(token_ids), self.block_size,
                                           medium))

    def removed(self, medium: str, h: bytes) -> None:
        """The last copy of ``h`` on ``medium`` went."""
        left = self._media.get(h, 0) & ~_BIT[medium]
        if left:
            self._media[h] = left
        else:
            self._media.pop(h, None)
            self._gone.append(h)
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(h)
        else:
            self.events.append(BlockRemoved([h], medium))

    def take(self) -> list[KVEvent]:
        """The events since the last call, oldest first (and forget hashes gone since)."""
        for h in self._gone:
            if h not in self._media:
                self._info.pop(h, None)
        self._gone.clear()
        out, self.events = self.events, []
        return out

    def present(self, medium: str) -> set[bytes]:
        """Hashes findable on ``medium`` as the events so far say (tests, checks)."""
        bit = _BIT[medium]
        return {h for h, m in self._media.items() if m & bit}
