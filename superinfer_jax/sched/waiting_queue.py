"""The waiting queue, in two orders at once: the queue's own and arrival's.

The scheduler admits from the head (FCFS; a request evicted for recomputation goes back
to the head). RotaSched's lag ranking reads the same requests by arrival: within one SLO
a fresh request's lag depends on ``now - arrival_time`` alone, so the late ones form one
window that a bisection finds, and ``walk`` skips, unread, the requests whose first chunk
needs more pages than are left. Every operation is O(1) or O(log n) in Python.
"""

from __future__ import annotations

import bisect
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from superinfer_jax.request import SLO, Request

__all__ = ["WaitingQueue"]

Key = tuple[float, int]  # (arrival_time, position)
Entry = tuple[float, int, "Request"]  # (arrival_time, position, request)


class WaitingQueue:
    """Waiting requests: a FIFO with a deque's verbs (and O(1) removal from the middle),
    the same requests sorted by ``(arrival_time, position)``, a count per SLO, and the
    arrival order per page need (``need``: pages a request's first chunk takes, 0 when
    not known ahead). ``append`` hands out increasing positions, ``appendleft`` decreasing
    negative ones, so position order is queue order and breaks arrival ties.

    ``requeued``: the requests back at the head (recomputation), the only ones that may
    have tokens, lag by another rule, or change their page need while they wait."""

    __slots__ = ("_fifo", "_entries", "_keys", "_next_back", "_next_front", "requeued",
                 "slos", "_need", "_needs", "_by_need")

    def __init__(self, need: Callable[[Request], int] | None = None) -> None:
        self._fifo: OrderedDict[int, Request] = OrderedDict()  # id(req) -> req, queue order
        self._entries: list[Entry] = []  # sorted
        self._keys: dict[int, Key] = {}  # id(req) -> its key
        self._next_back, self._next_front = 0, -1
        self.requeued: dict[int, Request] = {}  # id(req) -> req, back at the head
        self.slos: Counter[SLO] = Counter()  # SLO -> waiting requests with it
        self._need = need
        self._needs: dict[int, int] = {}  # id(req) -> its page need (0: unknown)
        self._by_need: dict[int, list[Entry]] = {}  # need -> entries with it, sorted

    def __len__(self) -> int:
        return len(self._fifo)

    def __bool__(self) -> bool:
        return bool(self._fifo)

    def __iter__(self) -> Iterator[Request]:
        """Queue order (the head first)."""
        return iter(self._fifo.values())

    def __contains__(self, req: object) -> bool:
        return id(req) in self._fifo

    def first(self) -> Request:
        """The head of the queue."""
        return next(iter(self._fifo.values()))

    def append(self, req: Request) -> None:
        fresh = not (req.token_times or req.num_inflight_tokens)
        self._insert(req, self._next_back, fresh)
        self._next_back += 1
        self._fifo[id(req)] = req
        if not fresh:
            self.requeued[id(req)] = req  # not a fresh request: rank it by hand

    def appendleft(self, req: Request) -> None:
        self._insert(req, self._next_front, False)
        self._next_front -= 1
        self._fifo[id(req)] = req
        self._fifo.move_to_end(id(req), last=False)
        self.requeued[id(req)] = req

    def remove(self, req: Request) -> None:
        key = self._keys.pop(id(req), None)
        if key is None:
            raise ValueError(f"request {req.req_id} is not waiting")
        del self._fifo[id(req)]
        self.requeued.pop(id(req), None)
        _delete(self._entries, key)
        need = self._needs.pop(id(req))
        same = self._by_need[need]
        _delete(same, key)
        if not same:
            del self._by_need[need]
        slos = self.slos
        slos[req.slo] -= 1
        if not slos[req.slo]:
            del slos[req.slo]

    def by_arrival(self) -> list[Entry]:
        """``(arrival_time, position, request)``, sorted; read-only."""
        return self._entries

    def entry(self, req: Request) -> Entry:
        """``req``'s ``(arrival_time, position, request)``, as ``by_arrival`` lists it."""
        return (*self._keys[id(req)], req)

    def missed_prefix(self, now: float) -> int:
        """How many of the first ``by_arrival`` entries are past their TTFT deadline by
        arrival time alone: the shortest of the per-SLO prefixes, one bisection per SLO.
        Callers test the ``requeued`` ones in it (they may have a first token)."""
        return min((self.first_within(now, slo.ttft_s) for slo in self.slos),
                   default=len(self._entries))

    def first_within(self, now: float, age: float) -> int:
        """The first ``by_arrival`` entry with ``now - arrival <= age`` (the length if
        none), by bisection; the callers' own float comparison, so the bounds are exact."""
        return bisect.bisect_left(self._entries, True, key=lambda e: now - e[0] <= age)

    def walk(self, room: Callable[[], int] | None = None, start: int = 0,
             stop: int | None = None) -> Iterator[Entry]:
        """``by_arrival[start:stop]`` in order; with ``room`` (pages still free, asked
        before each entry), entries whose known page need exceeds it are skipped unread:
        the next is the earliest next entry over the needs up to ``room()``."""
        entries, by_need = self._entries, self._by_need
        needs = sorted(by_need)
        top = needs[-1] if needs else 0
        end = len(entries) if stop is None else min(stop, len(entries))
        i = min(start, end)
        after: Key = entries[i][:2] if i < end else (float("inf"), 0)
        while True:
            free = room() if room is not None else top
            if top <= free:  # everyone left could fit by pages: read them in order
                if i >= end:
                    return
                e = entries[i]
            else:
                found: Entry | None = None
                for need in needs:
                    if need > free:
                        break
                    same = by_need[need]
                    j = bisect.bisect_left(same, after)
                    if j < len(same) and (found is None or same[j] < found):
                        found = same[j]
                if found is None:
                    return
                e = found
                i = bisect.bisect_left(entries, e[:2])
                if i >= end:
                    return
            after = (e[0], e[1] + 1)
            i += 1
            yield e

    def _insert(self, req: Request, position: int, fresh: bool) -> None:
        if id(req) in self._keys:
            raise ValueError(f"request {req.req_id} is waiting already")
        key = (req.arrival_time, position)
        self._keys[id(req)] = key
        entry = (*key, req)
        _insort(self._entries, entry)
        need = self._need(req) if fresh and self._need is not None else 0
        self._needs[id(req)] = need
        _insort(self._by_need.setdefault(need, []), entry)
        self.slos[req.slo] += 1


def _insort(entries: list[Entry], entry: Entry) -> None:
    """Insert in key order (keys are unique: the request is never compared)."""
    if not entries or entries[-1][:2] < entry[:2]:
        entries.append(entry)  # the common case: the latest arrival
    else:
        entries.insert(bisect.bisect_left(entries, entry[:2]), entry)


def _delete(entries: list[Entry], key: Key) -> None:
    del entries[bisect.bisect_left(entries, key)]
