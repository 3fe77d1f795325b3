"""What the simulator is asked to run: requests, closed-loop conversations, and synthetic
prompts whose block hashes match exactly where their ``hash_ids`` do (as in Mooncake)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import overload

from superinfer_jax.config import EngineConfig
from superinfer_jax.request import SLO

HASH_BLOCK_TOKENS = 512  # prompt tokens per hash id in the Mooncake traces
_MAX_TOKEN = 2**63 - 1  # block hashing packs token ids as int64


@dataclass(frozen=True)
class RequestSpec:
    """One simulated request. ``hash_ids``: its prompt content, one id per
    ``block_tokens`` tokens (equal ids, identical blocks); without them the request
    never uses the prefix cache."""

    arrival_s: float
    prompt_len: int
    output_len: int
    slo: SLO = field(default_factory=SLO)
    hash_ids: tuple[int, ...] | None = None
    block_tokens: int = HASH_BLOCK_TOKENS


@dataclass(frozen=True)
class ConversationSpec:
    """A closed-loop conversation: turn 0 arrives at ``start_s``, turn k+1 ``think_s[k +
    1]`` after turn k's last token (the turns' ``arrival_s`` is ignored), so a slow
    answer delays the next turn. Turn k+1's ``hash_ids`` extend turn k's."""

    start_s: float
    turns: tuple[RequestSpec, ...]
    think_s: tuple[float, ...]  # one per turn; think_s[0] is unused


class HashIdTokens(Sequence[int]):
    """The synthetic prompt of a spec with ``hash_ids``, computed on demand: token ``t`` is
    ``hash_ids[t // B] * B + t % B`` (``B`` = ``block_tokens``), so two prompts' pages are
    equal exactly where the ids of the blocks they cover are."""

    __slots__ = ("hash_ids", "block_tokens", "length")

    def __init__(self, hash_ids: tuple[int, ...], block_tokens: int, length: int):
        self.hash_ids, self.block_tokens, self.length = hash_ids, block_tokens, length

    def __len__(self) -> int:
        return self.length

    def __bool__(self) -> bool:
        # mypyc tests a native object's truth without ``__len__`` (see mypyc_build)
        return len(self) > 0

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        b, ids = self.block_tokens, self.hash_ids
        if isinstance(index, slice):
            start, stop, step = index.indices(self.length)
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            out: list[int] = []
            while start < stop:
                blk = start // b
                end = min(stop, (blk + 1) * b)
                base = (ids[blk] - blk) * b  # token t of block blk: ids[blk] * b + t - blk * b
                out.extend(range(base + start, base + end))
                start = end
            return out
        i = index + self.length if index < 0 else index
        if not 0 <= i < self.length:
            raise IndexError(f"token {index} of a {self.length}-token prompt")
        return (ids[i // b] - i // b) * b + i

    def __iter__(self) -> Iterator[int]:
        return iter(self[:])


def check_specs(specs: Sequence[RequestSpec], config: EngineConfig) -> None:
    last = float("-inf")
    for i, s in enumerate(specs):
        if s.arrival_s < last:
            raise ValueError(f"requests must be sorted by arrival_s (request {i}: "
                             f"{s.arrival_s} < {last})")
        _check_spec(f"request {i}", s, config)
        last = s.arrival_s


def _check_spec(name: str, s: RequestSpec, config: EngineConfig) -> None:
    if s.prompt_len < 1 or s.output_len < 1:
        raise ValueError(f"{name}: prompt_len and output_len must be >= 1, got "
                         f"{s.prompt_len}, {s.output_len}")
    if s.prompt_len >= config.model.max_model_len:
        raise ValueError(f"{name}: prompt has {s.prompt_len} tokens; max_model_len "
                         f"is {config.model.max_model_len} (the engine rejects it)")
    if s.hash_ids is not None:
        _check_hash_ids(name, s)


def check_conversations(convs: Sequence[ConversationSpec], config: EngineConfig) -> None:
    for i, c in enumerate(convs):
        if not c.turns:
            raise ValueError(f"conversation {i}: no turns")
        if len(c.think_s) != len(c.turns):
            raise ValueError(f"conversation {i}: {len(c.turns)} turns need as many think_s, "
                             f"got {len(c.think_s)}")
        if not 0 <= c.start_s < math.inf or any(not 0 <= x < math.inf for x in c.think_s):
            raise ValueError(f"conversation {i}: start_s and think_s must be finite and "
                             f">= 0, got {c.start_s}, {c.think_s}")
        for k, turn in enumerate(c.turns):
            _check_spec(f"conversation {i} turn {k}", turn, config)


def _check_hash_ids(name: str, s: RequestSpec) -> None:
    """Ids that cover the prompt exactly and keep every synthetic token an int64."""
    b = s.block_tokens
    if isinstance(b, bool) or not isinstance(b, int) or b < 1:
        raise ValueError(f"{name}: block_tokens must be an int >= 1, got {b!r}")
    want = -(-s.prompt_len // b)
    if len(s.hash_ids or ()) != want:
        raise ValueError(f"{name}: {s.prompt_len} prompt tokens need {want} hash ids "
                         f"(one per {b}-token block), got {len(s.hash_ids or ())}")
    if s.hash_ids and (min(s.hash_ids) < 0 or max(s.hash_ids) > _MAX_TOKEN // b - 1):
        raise ValueError(f"{name}: hash ids must be in [0, {_MAX_TOKEN // b - 1}], "
                         f"got {min(s.hash_ids)}..{max(s.hash_ids)}")
