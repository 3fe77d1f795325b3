"""DuplexKV: issues a step's page copies in both directions at once, never waits for them.

One engine step, in order (see ``engine.LLMEngine.step``):
  1. ``poll(pool)``: ask every copy in flight ``is_ready()``. A finished rotate-out makes
     its request ROTARY; arrived rotate-ins are scattered into the pool by one jitted
     call (pool donated) and their requests are runnable in this very step.
  2. The scheduler plans; ``TwoTierKVManager`` does the page bookkeeping (rotate_out
     frees device pages at once, rotate_in reserves them at once).
  3. ``execute(pool, moves_out, moves_in, shadows)``: issue the inbound copies (one
     batched ``device_put`` of the arriving host pages to the device), then gather the
     pages leaving the device and copy them to pinned_host. Returns at once.
  4. The engine dispatches the model step with the pool donated.

How the copies are made depends on ``PageMover.copy_mode`` (``duplexkv.mover``):
``device_put`` (GPU, TPU) gathers into device staging pages and moves them with batched
async ``device_put`` each way, as above; ``fused`` (CPU, where both memory kinds are the
same RAM) gathers straight into pinned_host arrays in (3), and an inbound request's host
pages are read straight into the pool by the scatter in (1): one copy per page each way
instead of two. ``in_step`` makes the copies inside the model step's own program (the
engine's runner defers them: ``poll(defer=True)``, ``execute(defer=True)``, then
``take_in_step`` for the step's first call, ``finish_in_step`` with its outputs, and
``flush`` for what no call took): arrived host pages are operands in pinned_host landed
first thing in the program, before the model; outbound pages are gathered last, after
the model, into outputs in pinned_host. What the call does not take (a count outside its
compiled bucket, a page it writes, a step whose first call has no in_step variant) goes
by ``fused`` mode's separate programs, dispatched before the call. The orderings below
hold in every mode; where they differ, it is said.

Read before write in ``in_step`` mode (pages reused in the same step). Within one
program there is no dispatch order, only dataflow: XLA may schedule any read of the pool
value the step received after an in-place write of it, or, as it does when it cannot
prove the order, copy the whole donated pool first (measured on XLA:CPU: a gather of the
received pool beside the step's writes cost two pool-sized copies per step;
``optimization_barrier`` did not order them). So the step never reads the received pool:
- *Outbound pages are gathered after every write of the step*, from the pool it
  returns, so the dataflow orders them and the pool stays in place. That is only right
  for pages the step does not write, and ``take_in_step`` gives it only those: the
  runner passes the pages its call writes KV to (every column of every row looked up in
  its page tables, padding included: a superset), and a page among them is gathered
  before the call by the separate gather (dispatch order, as in ``fused`` mode).
- *A page freed by a rotate-out and reused by a rotate-in of the same step* is not
  written by that step: its inbound copy lands no earlier than the next step's first
  call (``poll`` defers the landing; as in ``fused`` mode, where it lands in the next
  ``poll``), whose program starts from the pool this step's program returned, after
  this step's gather read it. The same holds for a page freed and given to a request
  scheduled in the same step: the request's KV write makes it a written page, gathered
  before the call.
- *Arrived pages land before anything reads them.* The landing is the program's first
  write and the model runs on its result; the request was made runnable by the
  ``poll`` that deferred its landing, and its rows run in this same call or a later one
  (a step's copies ride only its first call, so a later call of the step reads the pool
  the first returned). If no call runs, ``flush`` lands them before the next step.
- *A page that lands and leaves in one step* (its request made runnable by this step's
  ``poll`` and rotated out again by this step's plan) is gathered after it landed: in
  the program (landing first, gather last), or by the separate programs, which land
  before they gather (as ``fused`` mode's ``poll`` lands before ``execute`` gathers); a
  page gathered by the separate program (one the call writes) is landed by the separate
  program too, never by the call that follows (``_eligible_in``).
- *Host pages.* An inbound host page stays referenced by the deferred landing until the
  program that reads it is dispatched (the dispatched program then holds it); the
  outbound host pages are the step's own outputs, written once.

How each ordering is guaranteed (by JAX data dependencies, on CPU and GPU alike):
- *A page is read for eviction before a step that reuses it writes it.* The gather in
  (3) takes the pool as an input and is dispatched before the step in (4), which receives
  that same buffer donated. PJRT does not overwrite a donated buffer before computations
  already dispatched on it have read it (GPU: both run on the compute stream, in dispatch
  order; CPU: the donating execution waits on the buffer's pending usage events). The
  host copy then reads the gather's own output buffers, which nothing else writes (fused:
  the gather's outputs *are* the host pages).
- *A page freed by a rotate-out and reused by a rotate-in of the same step.* The in-copy
  writes fresh device arrays, not the pool (fused: it issues nothing yet); the pages enter
  the pool in a later step's (1), by a scatter whose input pool is the output of
  everything dispatched before it, the gather that read the page's previous owner
  included. Issuing the in-copy before the gather in (3) changes nothing here: neither
  reads what the other writes.
- *An arriving page is written before the step that reads it.* The scatter in (1)
  produces the pool the step in (4) consumes. And a request is scheduled only after its
  arrays reported ``is_ready()`` with no error, so an errored copy never enters the pool.
- *Host pages.* A host page array is written once, by the copy that creates it, and only
  read afterwards. Freeing a host page drops a reference; a copy in flight holds its own
  (fused: the inbound flight holds the host arrays its scatter will read, and the
  dispatched scatter holds them until it has). The host pages of a request coming in stay
  owned until its pages land (full pages as shadows, which are not reclaimable meanwhile;
  the tail until arrival).
- *Shadows.* A shadow copies a full page, and full pages are never written while their
  request owns them (appends go to the tail page); the gather reads the pool produced by
  the step that wrote the page's last token.

Failures: a copy that raises when issued, or whose arrays carry an error when observed
ready, yields a FAILED event and the engine falls back to recomputing the request.

Tensor parallelism: the pool, the staging pages and the host pages share one split over
KV heads (``superinfer_jax.dist.parallel``), so every device gathers, copies and scatters its
own slice of each page; the orderings above hold per device, and a copy is observed
ready only when every device's slice is.
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
    """Copies in flight for one request (or one step's shadows)."""

    req_id: str
    kind: str  # "out" | "in" | "shadow"
    arrays: list[jax.Array]  # out/shadow: host pages; in: what ``PageMover.scatter`` lands
    pages: list[int]  # in: device pages to land in; shadow: host pages written
    batch: CopyBatch


@dataclass
class _Deferred:
    """Outbound copies ``execute(defer=True)`` left for the model step (in_step mode)."""

    moves_out: list[PageMoves]
    shadows: list[PageMoves]
    t0: float


@dataclass
class _Taken:
    """Outbound copies a step took: host pages ``rest`` gathered before it (for the
    pages at ``rest_idx``); the step's own, for ``step_idx``, come with its outputs."""

    deferred: _Deferred
    rest: list[jax.Array]
    step_idx: list[int]
    rest_idx: list[int]


@dataclass(frozen=True)
class StepCopies:
    """The page copies one model step makes inside its own program (in_step mode):
    land ``in_pages`` (pinned_host) at ``pool[in_ids]`` before the model, gather
    ``pool[out_ids]`` to pinned_host after it (``mover.land_in_step``,
    ``mover.gather_in_step``)."""

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
    """The rotation engine over one device pool and one host pool."""

    def __init__(self, layout: PoolLayout, kv: TwoTierKVManager, host: HostPool,
                 budget_pages: int, pool_sharding: jax.sharding.NamedSharding | None = None,
                 copy_mode: str | None = None):
        """``pool_sharding``: the device pool's sharding under tensor parallelism (the host
        pool's pages must be split the same way); None for a one-device pool.
        ``copy_mode``: ``PageMover``'s (None: the backend's default)."""
        self.layout = layout
        self.kv = kv
        self.host = host
        self.budget_pages = budget_pages
        self.pool_sharding = pool_sharding
        self.mover = PageMover(layout, budget_pages, host.device_sharding, host.host_sharding,
                               pool_sharding, copy_mode)
        self.stats = TransferStats()
        self._flights: list[_Flight] = []
        # in_step mode, between ``execute(defer=True)`` and the step (``take_in_step``,
        # ``finish_in_step``) or ``flush``
        self._deferred: _Deferred | None = None
        self._landing: list[tuple[int, jax.Array]] = []  # (device page, host page)
        self._taken: _Taken | None = None
        self._failed_out: list[RotationEvent] = []

    @property
    def num_in_flight(self) -> int:
        return len(self._flights)

    def adopt(self, pool: jax.Array) -> jax.Array:
        """The pool committed to the device. Arrived pages are committed arrays, so the
        scatter returns a committed pool; a step compiled for an uncommitted one would
        compile again. Call before compiling anything that takes the pool."""
        return jax.device_put(pool, self.pool_sharding or self.host.device_sharding)

    def warmup(self, pool: jax.Array) -> jax.Array:
        return self.mover.warmup(pool)

    # -- step (1): observe ---------------------------------------------------------------

    def poll(self, pool: jax.Array, defer: bool = False) -> tuple[jax.Array, list[RotationEvent]]:
        """Observe finished copies and land arrived pages; returns the new pool.

        ``defer`` (``in_step`` mode only): arrived pages are not landed here but by the
        next call's program, first thing (``take_in_step``), or by ``flush``; the caller
        must call one of them before anything reads or writes the pool."""
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

    # -- step (3): issue -----------------------------------------------------------------

    def execute(self, pool: jax.Array, moves_out: list[PageMoves], moves_in: list[PageMoves],
                shadows: list[PageMoves], defer: bool = False) -> list[RotationEvent]:
        """Issue this step's copies; returns FAILED events for copies that failed to issue.

        Must run after the plan's bookkeeping and before the step that donates ``pool``.
        ``defer`` (``in_step`` mode only; the caller then must call ``take_in_step`` or
        ``flush`` before anything writes ``pool``): the outbound copies wait for the model
        step, which may take some of them (``take_in_step``); the inbound ones are issued
        as in ``fused`` mode (a later ``poll`` observes them)."""
        t0 = time.perf_counter()
        inbound = [self.host.get(list(m.host_pages)) for m in moves_in]  # before drops
        self._drop_freed()
        events: list[RotationEvent] = []
        if self._deferred is not None:
            raise RuntimeError("execute called again before the deferred copies were taken")
        # Inbound first: its copies need nothing from this step, and on CPU the gather
        # below runs in this thread (a copy-only program is run inline), so issued the
        # other way round the in-copy would wait for it instead of running beside it.
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

    # -- in_step mode: copies inside the model step ------------------------------------

    @property
    def in_step(self) -> bool:
        return self.mover.copy_mode == "in_step"

    @property
    def has_deferred(self) -> bool:
        """Whether copies wait for the next call (``take_in_step``) or ``flush``."""
        return self._deferred is not None or bool(self._landing)

    def in_step_pending(self, written: Collection[int] = ()) -> tuple[int, int]:
        """Deferred pages a call writing KV to the pages ``written`` could copy in its
        program: (out, in). An outbound page the call writes is not one: it is gathered
        before the call (see ``take_in_step``)."""
        return len(self._eligible_out(written)), len(self._eligible_in(written))

    def _device_ids_out(self) -> list[int]:
        if self._deferred is None:
            return []
        return [d for m in self._deferred.moves_out + self._deferred.shadows
                for d in m.device_pages]

    def _eligible_out(self, written: Collection[int]) -> list[int]:
        """Indices (into ``_device_ids_out``) of the deferred outbound pages a call that
        writes KV to ``written`` may gather after its model ran: those it does not write.
        A page landing now may be one (a request made runnable by this step's ``poll``
        and rotated out again by its plan): landed before the call or first thing in it,
        it is gathered after the landing either way."""
        written = set(written)
        return [k for k, d in enumerate(self._device_ids_out()) if d not in written]

    def _eligible_in(self, written: Collection[int]) -> list[int]:
        """Indices (into ``_landing``) of the arrived pages a call that writes KV to
        ``written`` may land: all but a page that also leaves in this step and is
        gathered before the call (it must land before that gather, so before the call)."""
        before = set(written) & set(self._device_ids_out())
        return [k for k, (d, _) in enumerate(self._landing) if d not in before]

    def take_in_step(self, pool: jax.Array, num_out: int, num_in: int,
                     written: Collection[int] = ()) -> tuple[jax.Array, StepCopies]:
        """Hand the call about to be dispatched on ``pool`` (which writes KV only to
        pages in ``written``) the first ``num_in`` arrived pages to land before its model
        and ``num_out`` deferred outbound pages to gather after it. What it does not take
        is copied now, by the separate programs, before the call: the arrived rest landed,
        then the outbound rest gathered (``_copy_out``, called even with no page, so a
        copy failure fails the batch as in the other modes; after the landing, as in
        ``fused`` mode, where ``poll`` lands before ``execute`` gathers: a page may land
        and leave in one step). Returns the pool the call takes; ``finish_in_step``
        takes its gathered host pages."""
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
        """Register the outbound copies of a step dispatched with ``take_in_step``'s
        copies: ``out_pages`` are its gathered host pages (not waited for)."""
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
        """Copy what ``poll(defer=True)`` and ``execute(defer=True)`` left for a call
        that did not take it, by the separate programs (before anything reads or writes
        ``pool``); returns the new pool and the copies that failed to issue."""
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
        """Outbound copies issued: ``arrays`` are the host pages of ``moves_out`` then
        ``shadows``, in order."""
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
        """Host page arrays of ``pool[device_ids]``: batched, asynchronous. The one place
        outbound copies are issued (tests patch it to fail)."""
        return self.mover.to_host(pool, device_ids)

    def _copy_in(self, host_pages: list[jax.Array]) -> list[jax.Array]:
        """What a later ``poll`` lands for these host pages: batched, asynchronous. The one
        place inbound copies are issued (tests patch it to fail)."""
        return self.mover.to_device(host_pages)

    def wait_all(self) -> None:
        """Block until every copy in flight completes. For benchmarks and tests: the
        engine never calls it (it observes completion with ``poll``)."""
        for f in self._flights:
            try:
                jax.block_until_ready(f.arrays)
            except Exception:  # noqa: BLE001 - poll reports it as FAILED
                pass

    # -- bookkeeping ---------------------------------------------------------------------

    def cancel(self, req_id: str) -> None:
        """Forget the copies of a finished or aborted request: nothing of it will land."""
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
