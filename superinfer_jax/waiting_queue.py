"""The waiting queue, in two orders at once: the queue's own and arrival's.

The scheduler admits from the head of the queue (FCFS; a request evicted for
recomputation goes back to the head, as it is older than anyone behind it). RotaSched's
lag ranking needs the same requests by arrival time: a waiting request's virtual lag is a
function of ``now - arrival_time`` alone for a given SLO, so arrival order *is* lag order
within one SLO, and the requests that are late but not yet hopeless lie in one window of
arrival times that a bisection finds. Keeping both orders here, updated as requests come
and go, is what lets a step rank without touching the whole queue (``rotasched.lag``).

Every operation is O(1) or O(log n) in Python, plus a C-level list shift for an insertion
or removal in the arrival list (a few microseconds at 100,000 requests).
"""

from __future__ import annotations

import bisect
from collections import Counter, OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from superinfer_jax.request import SLO, Request

__all__ = ["WaitingQueue"]


class WaitingQueue:
    """Waiting requests: a FIFO with ``append`` / ``appendleft`` / ``remove`` (a deque's
    verbs, with O(1) removal from the middle), the same requests sorted by
    ``(arrival_time, position)``, and a count per SLO.

    Positions: ``append`` hands out increasing numbers, ``appendleft`` decreasing negative
    ones, so sorting by position is the queue's order; a tie in arrival time is broken by
    it, as a stable sort over the queue would.

    ``requeued``: the requests that came back to the head (recomputation). Only those can
    have produced tokens (a fresh request has none until it runs), so only they can lag by
    another rule than their arrival time's: the ranking looks at each of them."""

    __slots__ = ("_fifo", "_entries", "_keys", "_next_back", "_next_front", "requeued",
                 "slos")

    def __init__(self) -> None:
        self._fifo: OrderedDict[int, Request] = OrderedDict()  # id(req) -> req, queue order
        self._entries: list[tuple[float, int, Request]] = []  # (arrival, position, req)
        self._keys: dict[int, tuple[float, int]] = {}  # id(req) -> its (arrival, position)
        self._next_back, self._next_front = 0, -1
        self.requeued: dict[int, Request] = {}  # id(req) -> req, back at the head
        self.slos: Counter[SLO] = Counter()  # SLO -> waiting requests with it

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
        self._insert(req, self._next_back)
        self._next_back += 1
        self._fifo[id(req)] = req
        if req.token_times or req.num_inflight_tokens:
            self.requeued[id(req)] = req  # not a fresh request: rank it by hand

    def appendleft(self, req: Request) -> None:
        self._insert(req, self._next_front)
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
        entries = self._entries
        del entries[bisect.bisect_left(entries, key)]
        slos = self.slos
        slos[req.slo] -= 1
        if not slos[req.slo]:
            del slos[req.slo]

    def by_arrival(self) -> list[tuple[float, int, Request]]:
        """``(arrival_time, position, request)``, sorted: read-only, valid until the queue
        changes."""
        return self._entries

    def entry(self, req: Request) -> tuple[float, int, Request]:
        """``req``'s ``(arrival_time, position, request)``, as ``by_arrival`` lists it."""
        return (*self._keys[id(req)], req)

    def _insert(self, req: Request, position: int) -> None:
        if id(req) in self._keys:
            raise ValueError(f"request {req.req_id} is waiting already")
        key = (req.arrival_time, position)
        self._keys[id(req)] = key
        entries = self._entries
        if not entries or entries[-1][:2] < key:
            entries.append((*key, req))  # the common case: the latest arrival
        else:
            entries.insert(bisect.bisect_left(entries, key), (*key, req))
        self.slos[req.slo] += 1
