"""The engine's stats, typed: what ``LLMEngine.stats()`` reports, field by field.

An ``EngineStats`` is also a read-only mapping of its flat keys
(``stats["device_pages_free"]``); ``EngineStats.from_dict`` reads that form back and
refuses a key it does not know, so a renamed stat fails a test instead of reading 0.
Without a host tier, ``host`` is None and the host-tier properties read 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from superinfer_jax.duplexkv.stats import TransferStats

_TRANSFER_PREFIX = "transfer_"
_TRANSFER_KEYS = tuple(_TRANSFER_PREFIX + f.name for f in dataclasses.fields(TransferStats))


@dataclass
class StepStats:
    """What one ``LLMEngine.step`` did: tokens, preemptions, rotations issued (each
    direction), and its host and wall time."""

    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_preempted: int = 0
    num_rotated_out: int = 0
    num_rotated_in: int = 0
    host_time_s: float = 0.0
    step_time_s: float = 0.0


@dataclass(frozen=True)
class HostTierStats:
    """The DuplexKV tier: requests parked there, its pages, and the copies made."""

    num_rotary: int  # requests whose KV is in host memory
    pages_total: int
    pages_free: int
    transfer: TransferStats  # cumulative copies, each way


@dataclass(frozen=True)
class PrefixCacheStats:
    """The prefix cache: prompt tokens looked up at admissions (``queries``) and found on
    the device (``hits``, as vLLM's) or, past that, in the host tier (``host_hits``);
    pages cached now in each tier (referenced by no request)."""

    queries: int
    hits: int
    cached_pages: int
    host_hits: int = 0
    host_cached_pages: int = 0

    @property
    def host_queries(self) -> int:
        """Tokens looked up in the host tier: those the device tier did not have (vLLM's
        ``external_prefix_cache_queries``, for its KV connector)."""
        return self.queries - self.hits


@dataclass(frozen=True)
class SpecDecodeStats:
    """Speculative decoding's counters (vLLM's ``spec_decode_*``): verify rows with a
    proposal, tokens proposed, tokens accepted, and accepted per proposal position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


@dataclass(frozen=True)
class EngineStats(Mapping[str, float]):
    num_running: int = 0
    num_waiting: int = 0
    device_pages_total: int = 0
    device_pages_free: int = 0
    host: HostTierStats | None = None  # None: no host tier
    num_requests_total: int | None = None  # admitted so far: the serving loop's count
    prefix_cache: PrefixCacheStats | None = None  # None: prefix caching off
    spec_decode: SpecDecodeStats | None = None  # None: speculative decoding off


    @property
    def num_rotary(self) -> int:
        return 0 if self.host is None else self.host.num_rotary

    @property
    def host_pages_total(self) -> int:
        return 0 if self.host is None else self.host.pages_total

    @property
    def host_pages_free(self) -> int:
        return 0 if self.host is None else self.host.pages_free

    @property
    def bytes_to_host(self) -> int:
        return 0 if self.host is None else self.host.transfer.bytes_out

    @property
    def bytes_to_device(self) -> int:
        return 0 if self.host is None else self.host.transfer.bytes_in

    @property
    def prefix_cache_queries(self) -> int:
        return 0 if self.prefix_cache is None else self.prefix_cache.queries

    @property
    def prefix_cache_hits(self) -> int:
        return 0 if self.prefix_cache is None else self.prefix_cache.hits

    def usage(self, tier: str) -> float:
        """Fraction of the tier's pages in use (0 when the tier does not exist)."""
        total, free = ((self.device_pages_total, self.device_pages_free) if tier == "device"
                       else (self.host_pages_total, self.host_pages_free))
        return 0.0 if total <= 0 else (total - free) / total


    def as_dict(self) -> dict[str, float]:
        """The flat dict the engine has always reported (``transfer_bytes_out``, ...)."""
        out: dict[str, float] = {
            "num_running": self.num_running, "num_waiting": self.num_waiting,
            "device_pages_total": self.device_pages_total,
            "device_pages_free": self.device_pages_free,
        }
        if self.host is not None:
            out.update(num_rotary=self.host.num_rotary, host_pages_total=self.host.pages_total,
                       host_pages_free=self.host.pages_free,
                       **{_TRANSFER_PREFIX + k: v
                          for k, v in dataclasses.asdict(self.host.transfer).items()})
        if self.prefix_cache is not None:
            out.update(prefix_cache_queries=self.prefix_cache.queries,
                       prefix_cache_hits=self.prefix_cache.hits,
                       prefix_cache_pages=self.prefix_cache.cached_pages,
                       prefix_cache_host_hits=self.prefix_cache.host_hits,
                       prefix_cache_host_pages=self.prefix_cache.host_cached_pages)
        if self.num_requests_total is not None:
            out["num_requests_total"] = self.num_requests_total
        spec = self.spec_decode
        if spec is not None:
            out.update({_SPEC_PREFIX + "num_drafts": spec.num_drafts,
                        _SPEC_PREFIX + "num_draft_tokens": spec.num_draft_tokens,
                        _SPEC_PREFIX + "num_accepted_tokens": spec.num_accepted_tokens})
            out.update({f"{_SPEC_POS}{i}": n for i, n in enumerate(spec.accepted_per_pos)})
        return out

    @classmethod
    def from_dict(cls, stats: Mapping[str, Any]) -> EngineStats:
        """From the engine's flat dict; a key the engine does not produce is a ValueError,
        and the host-tier keys come all together or not at all."""
        if isinstance(stats, EngineStats):
            return stats
        unknown = sorted(k for k in set(stats) - set(_ALL_KEYS)
                         if not k.startswith(_SPEC_POS))
        if unknown:
            raise ValueError(f"engine stats: unknown keys {unknown} (known: {list(_ALL_KEYS)})")
        for key, value in stats.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"engine stats: {key} must be a number, got {value!r}")
        host_keys = [k for k in _HOST_KEYS if k in stats]
        host = None
        if host_keys:
            missing = sorted(set(_HOST_KEYS) - set(host_keys))
            if missing:
                raise ValueError(f"engine stats: host tier keys missing: {missing}")
            transfer = TransferStats(**{k.removeprefix(_TRANSFER_PREFIX): stats[k]
                                        for k in _TRANSFER_KEYS})
            host = HostTierStats(int(stats["num_rotary"]), int(stats["host_pages_total"]),
                                 int(stats["host_pages_free"]), transfer)
        cache_keys = [k for k in _CACHE_KEYS if k in stats]
        cache = None
        if cache_keys:
            missing = sorted(set(_CACHE_KEYS) - set(cache_keys))
            if missing:
                raise ValueError(f"engine stats: prefix cache keys missing: {missing}")
            cache = PrefixCacheStats(int(stats["prefix_cache_queries"]),
                                     int(stats["prefix_cache_hits"]),
                                     int(stats["prefix_cache_pages"]),
                                     int(stats["prefix_cache_host_hits"]),
                                     int(stats["prefix_cache_host_pages"]))
        total = stats.get("num_requests_total")
        spec = None
        if _SPEC_PREFIX + "num_drafts" in stats:
            positions = sorted((int(k.removeprefix(_SPEC_POS)), int(v))
                               for k, v in stats.items() if k.startswith(_SPEC_POS))
            spec = SpecDecodeStats(int(stats[_SPEC_PREFIX + "num_drafts"]),
                                   int(stats.get(_SPEC_PREFIX + "num_draft_tokens", 0)),
                                   int(stats.get(_SPEC_PREFIX + "num_accepted_tokens", 0)),
                                   tuple(v for _, v in positions))
        return cls(spec_decode=spec, prefix_cache=cache,
                   num_running=int(stats.get("num_running", 0)),
                   num_waiting=int(stats.get("num_waiting", 0)),
                   device_pages_total=int(stats.get("device_pages_total", 0)),
                   device_pages_free=int(stats.get("device_pages_free", 0)),
                   host=host, num_requests_total=None if total is None else int(total))

    @cached_property
    def _flat(self) -> dict[str, float]:
        """``as_dict`` built once: the serving loop reads every key of every snapshot."""
        return self.as_dict()

    def __getitem__(self, key: str) -> float:
        return self._flat[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._flat)

    def __len__(self) -> int:
        return len(self._flat)


_HOST_KEYS = ("num_rotary", "host_pages_total", "host_pages_free", *_TRANSFER_KEYS)
_CACHE_KEYS = ("prefix_cache_queries", "prefix_cache_hits", "prefix_cache_pages",
               "prefix_cache_host_hits", "prefix_cache_host_pages")
_SPEC_PREFIX = "spec_decode_"
_SPEC_POS = "spec_decode_num_accepted_tokens_pos_"  # then the position, from 0
_ALL_KEYS = ("num_running", "num_waiting", "device_pages_total", "device_pages_free",
             *_HOST_KEYS, *_CACHE_KEYS, "num_requests_total",
             *(_SPEC_PREFIX + k for k in ("num_drafts", "num_draft_tokens",
                                          "num_accepted_tokens")))
