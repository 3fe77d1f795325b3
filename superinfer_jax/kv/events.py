"""KV-cache events: which full pages are findable by block hash, on which medium.

The engine's side of KV events (``serving.kv_events`` encodes and publishes them); a
consumer such as llm-d's KV-cache indexer replays the stream to know which prefixes each
pod holds. Events are per hash and medium, not per page: ``BlockStored(medium)`` when a
hash's first copy appears on a medium (``GPU``: ``PrefixCache.register``; ``CPU``:
``HostCache.insert``), ``BlockRemoved(medium)`` when its last copy there goes (device
eviction; a host page evicted, discarded or taken for a hit). So a consumer that adds on
stored and removes on removed holds exactly the hashes findable on each medium.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

MEDIUM_DEVICE = "GPU"  # vLLM's names for the tiers (an accelerator; host memory)
MEDIUM_HOST = "CPU"
_BIT = {MEDIUM_DEVICE: 1, MEDIUM_HOST: 2}


@dataclass
class BlockStored:
    """Full pages now findable on ``medium``: a chain of hashes and their tokens."""

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
    """Where the caches append their events, merged by kind and medium, and each present
    hash's parent and tokens (the host tier stores pages by hash alone)."""

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
