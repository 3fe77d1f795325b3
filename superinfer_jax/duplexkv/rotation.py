"""DuplexKV: issues a step's page copies in both directions at once, never waits for them.

One engine step: (1) ``poll(pool)`` observes copies (``is_ready()``) and scatters arrived
pages into the donated pool; (2) the scheduler plans (``TwoTierKVManager`` frees and
reserves device pages at once); (3) ``execute`` issues the inbound copies, then gathers
the outbound pages to pinned_host; (4) the model step runs on the donated pool. In
``in_step`` mode the runner defers the copies into the step's program (``defer``).

Race freedom, by JAX data dependencies (CPU and GPU alike):
- *A page is read for eviction before a step that reuses it writes it*: the gather in (3)
  takes the pool and is dispatched before the step that receives it donated, and PJRT
  does not overwrite a donated buffer before computations dispatched on it have read it
  (GPU: one stream, dispatch order; CPU: the donating execution waits on its usage
  events). The host copy reads the gather's own outputs (fused: they are the host pages).
- *A page freed by a rotate-out and reused by a rotate-in of the same step*: the in-copy
  writes fresh arrays, not the pool; they enter the pool in a later (1), by a scatter
  whose input is the output of everything dispatched before, that gather included.
- *An arriving page is written before the step that reads it*: the scatter in (1) makes
  the pool the step consumes, and only copies ready without error are landed.
- *Host pages* are written once, by the copy that creates them; freeing one drops a
  reference and a copy in flight holds its own. A request coming in keeps its host
  pages until they land (full pages as unreclaimable shadows, the tail until arrival).
- *Shadows* copy full pages (never written while their request owns them), gathered from
  the pool of the step that wrote their last token.

In ``in_step`` mode a program has only dataflow, and XLA copies the donated pool when a
read of the received pool is unordered with its writes, so the step never reads it:
- outbound pages are gathered after its last write, from the pool it returns, and only
  pages it does not write (``take_in_step`` gets a superset of the pages the call
  writes; those are gathered before the call by the separate program);
- a page freed and reused in one step lands no earlier than the next step's first call,
  whose program starts from the pool this step returned, after its gather read it; a
  page freed and given to a request scheduled in the same step is a written page;
- arrived pages land first in the program (only a step's first call takes copies, so
  later calls read what it returned; with no call, ``flush`` lands them);
- a page that lands and leaves in one step lands before it is gathered, in the program
  or by the separate programs (``_eligible_in``).

A failed copy yields FAILED and the engine recomputes the request. Under tensor
parallelism each device copies its own slice of each page (``dist.parallel``): the
orderings hold per device, and a copy is ready when every slice is.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import cast

import jax
import numpy as np

from superinfer_jax.duplexkv.mover import PageMover
from superinfer_jax.duplexkv.stats import CopyBatch, TransferStats
from superinfer_jax.kv.host_pool import HostPool
from superinfer_jax.kv.layout import PoolLayout
from superinfer_jax.kv.two_tier import PageMoves, TwoTierKVManager


class EventKind(enum.Enum):
    ROTATED_OUT = "rotated_out"  # every page of the request is on the host
    ROTATED_IN = "rotated_in"  # every page landed in the pool: the request may run
    FAILED = "failed"  # a copy failed: recompute the request


@dataclass(frozen=True)
class RotationEvent:
    req_id: str
    kind: EventKind


@dataclass
class _Flight:

    req_id: str
    kind: str  # "out" | "in" | "shadow"
    arrays: list[jax.Array]  # out/shadow: host pages; in: what ``PageMover.scatter`` lands
    pages: list[int]  # in: device pages to land in; shadow: host pages written
    batch: CopyBatch


@dataclass
class _Deferred:
    """Outbound copies ``execute(defer=True)`` left for the model step."""

    moves_out: list[PageMoves]
    shadows: list[PageMoves]
    t0: float


@dataclass
class _Taken:
    """Outbound copies a step took: ``rest`` gathered before it, the rest with it."""

    deferred: _Deferred
    rest: list[jax.Array]
    step_idx: list[int]
    rest_idx: list[int]


@dataclass(frozen=True)
class StepCopies:
    """Copies a model step makes in its program: land ``in_pages``, gather ``out_ids``."""

    out_ids: np.ndarray  # [num_out] int32
    in_ids: np.ndarray  # [num_in] int32
    in_pages: tuple[jax.Array, ...]  # num_in host pages


def _arrived(arrays: list[jax.Array]) -> bool | None:
    """None while any copy is pending; then True, or False when one carries an error."""
    try:
        if not all(a.is_ready() for a in arrays):  # type: ignore[attr-defined]  # not in stubs
            return None
        jax.block_until_ready(arrays)  # all ready: returns at once, or raises their error
    except Exception:  # noqa: BLE001 - any transfer error means: recompute
        return False
    return True


class DuplexKV:

    def __init__(self, layout: PoolLayout, kv: TwoTierKVManager, host: HostPool,
                 budget_pages: int, pool_sharding: jax.sharding.NamedSharding | None = None,
                 copy_mode: str | None = None):
        self.layout = layout
        self.kv = kv
        self.host = host
        self.budget_pages = budget_pages
        self.pool_sharding = pool_sharding
        self.mover = PageMover(layout, budget_pages, host.device_sharding, host.host_sharding,
                               pool_sharding, copy_mode)
        self.stats = TransferStats()
        self._flights: list[_Flight] = []
        # in_step mode: between ``execute(defer=True)`` and the step or ``flush``
        self._deferred: _Deferred | None = None
        self._landing: list[tuple[int, jax.Array]] = []  # (device page, host page)
        self._taken: _Taken | None = None
        self._failed_out: list[RotationEvent] = []

    @property
    def num_in_flight(self) -> int:
        return len(self._flights)

    def adopt(self, pool: jax.Array) -> jax.Array:
        """The pool committed, as the scatter returns it (call before compiling on it)."""
        return jax.device_put(pool, self.pool_sharding or self.host.device_sharding)

    def warmup(self, pool: jax.Array) -> jax.Array:
        return self.mover.warmup(pool)


    def poll(self, pool: jax.Array, defer: bool = False) -> tuple[jax.Array, list[RotationEvent]]:
        """Observe finished copies and land arrived pages (unless ``defer``): the new pool."""
        self._drop_freed()
        now = time.perf_counter()
        events: list[RotationEvent] = []
        landing: list[_Flight] = []
        pending: list[_Flight] = []
        for f in self._flights:
            ok = _arrived(f.arrays)
            if ok is None:
                pending.append(f)
                continue
            if f.kind != "in" or not ok:
                f.batch.done_one(now, self.stats)
            if f.kind == "shadow":
                if not ok:
                    self._shadow_failed(f.pages, f.arrays)
            elif not ok:
                self.stats.failures += 1
                events.append(RotationEvent(f.req_id, EventKind.FAILED))
            elif f.kind == "out":
                self.kv.finish_rotate_out(f.req_id)
                events.append(RotationEvent(f.req_id, EventKind.ROTATED_OUT))
            else:
                landing.append(f)
        self._flights = pending
        if landing:
            ids = [d for f in landing for d in f.pages]
            arrays = [a for f in landing for a in f.arrays]
            if defer and self.in_step:
                self._landing += list(zip(ids, arrays, strict=True))
            else:
                pool = self.mover.scatter(pool, ids, arrays)
            now = time.perf_counter()  # fused mode's in-copy is this scatter: count it
            for f in landing:
                f.batch.done_one(now, self.stats)
                self.kv.finish_rotate_in(f.req_id)
                events.append(RotationEvent(f.req_id, EventKind.ROTATED_IN))
        return pool, events


    def execute(self, pool: jax.Array, moves_out: list[PageMoves], moves_in: list[PageMoves],
                shadows: list[PageMoves], defer: bool = False) -> list[RotationEvent]:
        """Issue this step's copies before the step that donates ``pool``; FAILED events."""
        t0 = time.perf_counter()
        inbound = [self.host.get(list(m.host_pages)) for m in moves_in]  # before drops
        self._drop_freed()
        events: list[RotationEvent] = []
        if self._deferred is not None:
            raise RuntimeError("execute called again before the deferred copies were taken")
        # Inbound first: it needs nothing from this step, and on CPU the gather below
        # runs inline in this thread, so the in-copy would otherwise wait for it.
        if moves_in:
            events += self._issue_in(moves_in, inbound, t0)
        if moves_out or shadows:
            if defer and self.in_step:
                self._deferred = _Deferred(moves_out, shadows, t0)
            else:
                events += self._issue_out(pool, moves_out, shadows, t0)
        self.stats.failures += len(events)
        self.stats.dispatch_s += time.perf_counter() - t0
        return events


    @property
    def in_step(self) -> bool:
        return self.mover.copy_mode == "in_step"

    @property
    def has_deferred(self) -> bool:
        return self._deferred is not None or bool(self._landing)

    def in_step_pending(self, written: Collection[int] = ()) -> tuple[int, int]:
        """(out, in) deferred pages a call writing KV to ``written`` could copy."""
        return len(self._eligible_out(written)), len(self._eligible_in(written))

    def _device_ids_out(self) -> list[int]:
        if self._deferred is None:
            return []
        return [d for m in self._deferred.moves_out + self._deferred.shadows
                for d in m.device_pages]

    def _eligible_out(self, written: Collection[int]) -> list[int]:
        """Deferred outbound pages (indices) a call may gather: those it does not write."""
        written = set(written)
        return [k for k, d in enumerate(self._device_ids_out()) if d not in written]

    def _eligible_in(self, written: Collection[int]) -> list[int]:
        """Arrived pages (indices) a call may land: not one gathered before the call."""
        before = set(written) & set(self._device_ids_out())
        return [k for k, (d, _) in enumerate(self._landing) if d not in before]

    def take_in_step(self, pool: jax.Array, num_out: int, num_in: int,
                     written: Collection[int] = ()) -> tuple[jax.Array, StepCopies]:
        """Give the next call on ``pool`` (writing KV to ``written``) ``num_in`` pages to land
        and ``num_out`` to gather; copy the rest now (landed, then gathered)."""
        eligible, eligible_in = self._eligible_out(written), self._eligible_in(written)
        if len(eligible) < num_out or len(eligible_in) < num_in:
            raise ValueError(f"{num_out} out / {num_in} in asked, {len(eligible)} / "
                             f"{len(eligible_in)} may go in the step")
        in_step_land = set(eligible_in[:num_in])
        landing = [x for k, x in enumerate(self._landing) if k in in_step_land]
        later = [x for k, x in enumerate(self._landing) if k not in in_step_land]
        self._landing = []
        if later:
            pool = self.mover.scatter(pool, [d for d, _ in later], [a for _, a in later])
        device_ids = self._device_ids_out()
        deferred, self._deferred = self._deferred, None
        self._taken = None
        step_idx = eligible[:num_out]
        chosen = set(step_idx)
        rest_idx = [k for k in range(len(device_ids)) if k not in chosen]
        if deferred is not None:
            try:
                rest = self._copy_out(pool, [device_ids[k] for k in rest_idx])
            except Exception:  # noqa: BLE001 - nothing will reach the host
                self.kv.drop_shadows([h for m in deferred.shadows for h in m.host_pages])
                self._failed_out = [RotationEvent(m.req_id, EventKind.FAILED)
                                    for m in deferred.moves_out]
                self.stats.failures += len(self._failed_out)
            else:
                self._taken = _Taken(deferred, rest, step_idx, rest_idx)
        self.stats.pages_in_step += num_out + num_in
        return pool, StepCopies(np.asarray([device_ids[k] for k in step_idx], np.int32),
                                np.asarray([d for d, _ in landing], np.int32),
                                tuple(a for _, a in landing))

    def finish_in_step(self, out_pages: Sequence[jax.Array]) -> list[RotationEvent]:
        """Register a step's outbound copies: ``out_pages``, its gathered host pages."""
        events, self._failed_out = self._failed_out, []
        taken, self._taken = self._taken, None
        if taken is not None:
            arrays: list[jax.Array | None] = [None] * (len(taken.step_idx) + len(taken.rest_idx))
            for k, a in zip(taken.step_idx, out_pages, strict=True):
                arrays[k] = a
            for k, a in zip(taken.rest_idx, taken.rest, strict=True):
                arrays[k] = a
            d = taken.deferred
            self._register_out(d.moves_out, d.shadows, cast(list[jax.Array], arrays), d.t0)
        return events

    def flush(self, pool: jax.Array) -> tuple[jax.Array, list[RotationEvent]]:
        """Copy what no call took by the separate programs; the new pool and failures."""
        events: list[RotationEvent] = []
        landing, self._landing = self._landing, []
        if landing:  # first: a page may land and leave in one step (see take_in_step)
            pool = self.mover.scatter(pool, [d for d, _ in landing], [a for _, a in landing])
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            events = self._issue_out(pool, deferred.moves_out, deferred.shadows, deferred.t0)
            self.stats.failures += len(events)
        return pool, events

    def _issue_out(self, pool: jax.Array, moves_out: list[PageMoves],
                   shadows: list[PageMoves], t0: float) -> list[RotationEvent]:
        moves = moves_out + shadows
        device_ids = [d for m in moves for d in m.device_pages]
        try:
            arrays = self._copy_out(pool, device_ids)
        except Exception:  # noqa: BLE001 - nothing reached the host
            self.kv.drop_shadows([h for m in shadows for h in m.host_pages])
            return [RotationEvent(m.req_id, EventKind.FAILED) for m in moves_out]
        self._register_out(moves_out, shadows, arrays, t0)
        return []

    def _register_out(self, moves_out: list[PageMoves], shadows: list[PageMoves],
                      arrays: list[jax.Array], t0: float) -> None:
        """``arrays``: the host pages of ``moves_out`` then ``shadows``, in order."""
        host_ids = [h for m in moves_out + shadows for h in m.host_pages]
        self.host.put(host_ids, arrays)
        num_shadow = sum(len(m) for m in shadows)
        self._count_out(len(host_ids), num_shadow, len(moves_out))
        batch = CopyBatch("out", t0)
        for m in moves_out:  # done when every host page of the request is, shadows too
            parked = self.host.get(self.kv.host_table(m.req_id))
            self._add(_Flight(m.req_id, "out", parked, [], batch))
        if shadows:
            self._add(_Flight("", "shadow", arrays[len(arrays) - num_shadow:],
                              host_ids[len(host_ids) - num_shadow:], batch))

    def _issue_in(self, moves_in: list[PageMoves], inbound: list[list[jax.Array]],
                  t0: float) -> list[RotationEvent]:
        try:
            arrays = self._copy_in([a for arrs in inbound for a in arrs])
        except Exception:  # noqa: BLE001 - nothing will land
            return [RotationEvent(m.req_id, EventKind.FAILED) for m in moves_in]
        self.stats.pages_in += len(arrays)
        self.stats.bytes_in += len(arrays) * self.layout.page_bytes
        hits = sum(m.prefix_hit for m in moves_in)
        self.stats.rotations_in += len(moves_in) - hits
        self.stats.prefix_hits_in += hits
        batch = CopyBatch("in", t0)
        start = 0
        for m in moves_in:
            self._add(_Flight(m.req_id, "in", arrays[start:start + len(m)],
                              list(m.device_pages), batch))
            start += len(m)
        return []

    def _copy_out(self, pool: jax.Array, device_ids: list[int]) -> list[jax.Array]:
        """Host page arrays of ``pool[device_ids]``, asynchronous (tests patch it)."""
        return self.mover.to_host(pool, device_ids)

    def _copy_in(self, host_pages: list[jax.Array]) -> list[jax.Array]:
        """What a later ``poll`` lands for these host pages (tests patch it)."""
        return self.mover.to_device(host_pages)

    def wait_all(self) -> None:
        """Block until every copy in flight completes (benchmarks, tests)."""
        for f in self._flights:
            try:
                jax.block_until_ready(f.arrays)
            except Exception:  # noqa: BLE001 - poll reports it as FAILED
                pass


    def cancel(self, req_id: str) -> None:
        now = time.perf_counter()
        keep = []
        for f in self._flights:
            if f.req_id == req_id and f.kind != "shadow":
                f.batch.done_one(now, self.stats)
            else:
                keep.append(f)
        self._flights = keep
        self._drop_freed()

    def _add(self, flight: _Flight) -> None:
        flight.batch.remaining += 1
        self._flights.append(flight)

    def _count_out(self, num_pages: int, num_shadow: int, num_rotations: int) -> None:
        self.stats.pages_out += num_pages
        self.stats.bytes_out += num_pages * self.layout.page_bytes
        self.stats.shadow_pages += num_shadow
        self.stats.rotations_out += num_rotations

    def _shadow_failed(self, host_pages: list[int], arrays: list[jax.Array]) -> None:
        """Forget the shadows whose copy failed, unless the host page was reused since."""
        still = [h for h, a in zip(host_pages, arrays, strict=True) if self.host.holds(h, a)]
        self.kv.drop_shadows(still)

    def _drop_freed(self) -> None:
        self.host.drop(self.kv.take_freed_host_pages())
