"""Jitted page gather and scatter on the device pool, over bucketed staging shapes, and the
copies between the pool and the host tier in one of three modes.

Gather: ``pool[ids]`` into ``B`` separate page arrays (one buffer per page, so each page
is one array of its own on the host); ``B`` is a bucket (powers of 2 up to
``max_pages``), so a handful of compiles cover every step. Scatter: arrived page arrays
into the donated pool, in place. A batch of ``n`` pages is cut into buckets that sum to
``n`` exactly (37 = 32 + 4 + 1), never padded up to a larger one: a padding row is a
real page copy (a 33-page batch padded to 64 would copy almost twice the bytes), while
an extra call costs only a dispatch.

Copy modes (``copy_mode``; ``default_copy_mode`` picks one per backend):

- ``device_put`` (GPU, TPU): gather into device staging pages, one batched async
  ``jax.device_put`` of them to pinned_host; inbound, one batched ``device_put`` of the
  host pages to the device, scattered into the pool when observed arrived. The copies
  run on the runtime's transfer streams, beside the model step on the compute stream:
  that is what makes rotation overlap compute. Each page is copied twice in the device's
  memory (gather or scatter) and once over the link.
- ``fused`` (CPU): the gather writes its page arrays straight into pinned_host memory
  (the jitted function's outputs carry the host memory kind) and the scatter reads the
  host pages straight into the pool (``jax.device_put(page, Space.Device)`` inside the
  jitted function). On CPU both memory kinds are the same RAM and XLA:CPU reads and
  writes host-kind operands in place (no copy in the compiled HLO), so each page is
  copied once per direction instead of twice. Measured on the 2-core CPU box (1 GiB of
  2 MiB pages, ``python -m benchmarks.duplex``, numpy memcpy 20 GB/s): fused 18.2 GB/s
  out, 17.7 in; device_put 8.9 out, 8.5 in; a SmolLM2 decode step moving 32 pages each
  way slows by 10-12% fused, 18-23% device_put. It is not the GPU mode because a copy
  inside a jitted function runs in the program on the compute stream, serialised with
  the model step (so it is on CPU too: XLA:CPU runs one program at a time per device, and
  only ``device_put`` copies run beside one; but there they add a second copy per page).
- ``in_step`` (opt-in, ``EngineConfig.copy_mode``): the copies go *inside*
  the model step's own program (``land_in_step`` first, ``gather_in_step`` last; the
  runner and ``DuplexKV.take_in_step`` drive it), with the host pages as pinned_host
  operands and the gathered pages as pinned_host outputs; copies the step does not take
  go by ``fused`` mode's programs. Standalone (no step), it is ``fused``.

Copies inside the step, revisited. The argument above kept copies out of the step so
that they could run beside it; on CPU nothing runs beside it, so a separate copy program
is only a second and third program per step (the scatter in ``poll``, the gather in
``execute``), each dispatched and run in turn, and ``in_step`` folds them into the step.
Measured with ``python -m benchmarks.duplex`` (overlap rows: SmolLM2 random f32, batch 8,
modes interleaved in one run) on the shared 2-core box under load average 5-10, which
inflated a step alone from tens of ms to about 200-240 ms with +-50 ms between rounds.
Added step time per mode (fused / device_put / in_step):
  full (ctx 256, 32 pages = 23.6 MB each way, 10 rounds of 5 steps), three runs:
  +40.1 / +62.6 / +3.0 ms and +39.7 / +41.1 / +35.9 ms (floor, one copy each way at the
  run's memcpy of 6.6-6.7 GB/s under the load, 7.1 ms), then -0.8 / +13.0 / +17.8 ms
  (floor 5.9 ms; copied beside the steps, 9.0 ms);
  ``--quick`` (ctx 128, 16 pages, 4 rounds), two runs: +12.0 / +6.2 / +7.8 ms (floor
  3.1) and +32.3 / +33.5 / +38.2 ms (floor 5.9; the same bytes copied beside the steps:
  9.6 ms, so 3.4x / 3.5x / 4.0x of it).
Tokens were equal in every mode and run. No mode wins beyond that noise, and none meets
the 1.2x-of-floor goal under this load, so the defaults stay: ``fused`` on CPU (in_step
would add three compiles per decode bucket for no measured gain), ``device_put`` on GPU
(no GPU was available to measure in_step; there XLA turns pinned_host operands and
outputs into asynchronous copy-start/copy-done, but this step gathers *last*, below, so
its outbound copies cannot overlap its own compute). Rerun on a quiet machine (and on a
GPU) before changing either.

Where a rotation's added step time goes on CPU (issue #16; SmolLM2 random f32, batch 8,
``python -m benchmarks.duplex_attribution`` and ``benchmarks.duplex --only-overlap``,
2-core box with another engineer's jobs beside, load average 0.7-3.7). Full row, 32
pages (23.6 MB) each way, fused: the scatter program (inline in ``poll``) 4.3-4.7 ms,
the gather program (inline in ``execute``, on two threads) 2.6-3.0 ms, host Python
around them ~0.9 ms (``_arrived`` 0.25; dropping, registering and issuing pages ~0.45),
page bookkeeping 0.1 ms, the step after them -0.1 to +0.9 ms: 7.9-8.9 ms added, 2.1-2.3x
the goal's floor (3.65-3.83 ms: one copy each way at the run's memcpy ceiling, 12-13
GB/s). The same pages copied by numpy in the same loop cost 5.3-6.7 ms (1.4-2.1x that
floor), the benchmark's interleaved floor 6.6-7.2 ms (the rotation is 1.1-1.3x of it;
``in_step`` 1.04x once). Why even a perfect copy stays well above the floor: the ceiling
copies 1 GiB, which glibc does with non-temporal stores (above its 190 MB threshold),
while the rotation's pages are cold after a step that streamed the weights through the
caches and are copied with regular stores, each line read before it is written: about 7
GB/s, numpy or XLA, against 12.8-13.9 GB/s for the same 12-24 MB with non-temporal
stores forced (``GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold``). XLA:CPU cannot
be asked for those: every page copy, dynamic or static slice, gather or in-place update,
compiles to a loop kernel (no memcpy), the dynamic ones to scalar 4-byte moves
(objdump); alone on cold pages they copy 4.1-6.0 GB/s (numpy 6.8), inside the step loop
1.2-1.4x the time numpy takes for the same pages (the scatter most: one thread). Ruled
out, measured: page faults (0-0.5 per copy call; the same added time with or without the
benchmark's ``mallopt``); copying beside the step on another thread (the step already
keeps 1.78 of the 2 cores busy: numpy copies on a thread added 2.6 ms quick / 7.0 full
against 3.2 / 6.7 serial); two threads per copy (cold pages 6.2 GB/s vs 7.0 on one, with
the other core shared); other codegen (a flat page view makes XLA copy the whole pool;
``xla_cpu_use_fusion_emitters``, ``xla_cpu_prefer_vector_width=512``: no change); a
memmove custom call (0.67 ms less on the ``--quick`` row's added 4.85 ms, 1.12 ms less
on the full row's 10.03 ms: still 2.8x the floor, and only through the untyped
custom-call API, which XLA:CPU reports as deprecated).

Since then (session 19), fused mode's two programs call ``native.gather_pages`` and
``native.scatter_pages`` on CPU (``ops/native/page_copy.cc``, typed FFI): one copy per
page with non-temporal stores, split over the intra-op threads, byte-exact. In the
duplex overlap row (idle box, full row, 32 pages each way) the rotation's copy calls took
3.7-4.1 ms against 5.1-5.4 ms through XLA's loops; the step after a rotation varied by
+-3 ms between runs either way, so the added time per rotating step (4.7-6.5 ms native,
2.7-8.1 ms XLA, floor 3.4-4.2 ms) does not yet show the gain reliably.
``NATIVE_PAGE_COPIES`` (module flag) switches them off for A/B runs.

Why the step gathers last: a gather of the pool the step *received* is unordered, in the
dataflow, with the step's in-place writes of that pool, and XLA:CPU then copies the
whole donated pool twice per step to keep them apart (``optimization_barrier`` did not
help). Gathered after the step's last write, the reads are ordered by data and the pool
stays in place; ``duplexkv.rotation`` says why that still reads every page before it is
reused. Compiles: one count bucket per direction (``EngineConfig.in_step_pages``) times
the decode buckets, 3 programs each (out, in, both).

On XLA:CPU, in-place updates of a bfloat16 array are upcast to float32 over the *whole*
array (measured: 4 pages into a 256 MiB bf16 pool 125 ms, f32 0.6 ms), so a bf16 pool
on CPU pays a pool-sized conversion per scatter; GPUs update bf16 in place.

    pool   [num_pages, num_layers, 2, page_size, kv_heads, head_dim]   (block-first)
    page   [num_layers, 2, page_size, kv_heads, head_dim]              (one contiguous run)
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from superinfer_jax.config import COPY_MODES
from superinfer_jax.kv.layout import NULL_PAGE, PoolLayout
from superinfer_jax.ops import native

NATIVE_PAGE_COPIES = True  # fused mode's copies through page_copy.cc on CPU (off: XLA's)

MAX_BUCKET_PAGES = 64  # pages per staging batch: 128 MiB of Llama-3-8B pages
HOST_OPERAND_MODES = ("fused", "in_step")  # the separate programs read/write host pages


def default_copy_mode(platform: str | None = None) -> str:
    """``fused`` on CPU (one copy per page each way, see the module docstring), else
    ``device_put`` (copies on the transfer streams, overlapped with compute). ``in_step``
    is opt-in (``EngineConfig.copy_mode``): it did not measurably beat ``fused`` on CPU
    (below) and costs three more compiles per decode bucket; unmeasured on GPU."""
    return "fused" if (platform or jax.default_backend()) == "cpu" else "device_put"


def staging_buckets(max_pages: int) -> tuple[int, ...]:
    """Staging batch sizes: 1, 2, 4, 8, ... up to ``max_pages`` (included)."""
    out, b = [], 1
    while b < max_pages:
        out.append(b)
        b *= 2
    out.append(max_pages)
    return tuple(out)


def _gather(pool: jax.Array, ids: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(pool[ids[i]] for i in range(ids.shape[0]))


def _scatter(pool: jax.Array, ids: jax.Array, pages: tuple[jax.Array, ...]) -> jax.Array:
    # One in-place dynamic-update-slice per page: no [B, ...] staging copy is built (on
    # CPU this measured 5x faster than a scatter of the stacked pages).
    for i, page in enumerate(pages):
        pool = jax.lax.dynamic_update_index_in_dim(pool, page.astype(pool.dtype), ids[i], 0)
    return pool


def _gather_native(pool: jax.Array, ids: jax.Array) -> tuple[jax.Array, ...]:
    """``_gather`` as one streaming copy per page on CPU (``native.gather_pages``); XLA's
    slices elsewhere. One device only: a custom call has no sharding rule, and on a
    sharded pool the partitioner would gather the pool to run it."""
    return jax.lax.platform_dependent(pool, ids, cpu=native.gather_pages, default=_gather)


def _scatter_native(pool: jax.Array, ids: jax.Array,
                    pages: tuple[jax.Array, ...]) -> jax.Array:
    """``_scatter`` as one streaming copy per page on CPU (``native.scatter_pages``, in
    place); one device only, as ``_gather_native``."""
    pages = tuple(p.astype(pool.dtype) for p in pages)
    return jax.lax.platform_dependent(
        pool, ids, *pages, cpu=lambda pool, ids, *pages: native.scatter_pages(pool, ids, pages),
        default=lambda pool, ids, *pages: _scatter(pool, ids, pages))


def _scatter_from_host(pool: jax.Array, ids: jax.Array, pages: tuple[jax.Array, ...],
                       scatter=_scatter) -> jax.Array:
    # The host pages enter the program in host memory; moving each to the device here is
    # what lets XLA:CPU copy it once, straight into the pool (fused mode).
    return scatter(pool, ids, tuple(jax.device_put(p, jax.memory.Space.Device) for p in pages))


def land_in_step(pool: jax.Array, in_ids: jax.Array,
                 in_pages: tuple[jax.Array, ...]) -> jax.Array:
    """``in_step`` mode, traced into the model step before the model: the host pages
    ``in_pages`` (operands in pinned_host) written to ``pool[in_ids]``, so they are in
    the pool before anything in the step could read them."""
    return _scatter_from_host(pool, in_ids, in_pages) if in_pages else pool


def gather_in_step(pool: jax.Array, out_ids: jax.Array) -> tuple[jax.Array, ...]:
    """``in_step`` mode, traced into the model step after the model, on the pool the
    step returns: ``pool[out_ids]`` (the caller's ``out_shardings`` put them in
    pinned_host). The step must not write these pages (``DuplexKV.take_in_step`` gives
    it only pages it does not write), so they hold what they held before the step.

    Why last and not first: a gather of the pool the step *received* is unordered, in
    the dataflow, with the step's in-place writes of that pool, and XLA keeps them apart
    by copying the whole donated pool (measured on XLA:CPU: two pool-sized copies per
    step; ``jax.lax.optimization_barrier`` does not help, it is expanded to control
    dependencies that are gone by copy insertion). Read after the last write, the
    gather is ordered by data and the pool stays in place (no copy)."""
    return _gather(pool, out_ids)


class PageMover:
    """Batched whole-page gather/scatter over a block-first pool, and the copies between
    the pool and host page arrays (``to_host``, ``to_device``, ``scatter``)."""

    def __init__(self, layout: PoolLayout, max_pages: int,
                 device_sharding: jax.sharding.Sharding,
                 host_sharding: jax.sharding.Sharding,
                 pool_sharding: jax.sharding.NamedSharding | None = None,
                 copy_mode: str | None = None):
        """``device_sharding`` / ``host_sharding``: one page in device / host memory.
        ``pool_sharding`` (tensor parallelism): the pool's sharding over a mesh; pages are
        then split the same way, so every gather and scatter stays on each device's own
        slice. ``copy_mode``: ``device_put`` or ``fused`` (None: ``default_copy_mode``)."""
        self.layout = layout
        device: Any = next(iter(device_sharding.device_set))  # jax.Device: no stubs
        self.copy_mode = copy_mode or default_copy_mode(device.platform)
        if self.copy_mode not in COPY_MODES:
            raise ValueError(f"copy_mode must be one of {COPY_MODES}, got {self.copy_mode!r}")
        self.device_sharding = device_sharding
        self.host_sharding = host_sharding
        self.buckets = staging_buckets(max(1, min(max_pages, MAX_BUCKET_PAGES)))
        fused = self.host_operands
        gather_out = host_sharding if fused else (device_sharding if pool_sharding else None)
        # Fused copies through the native custom calls on one device (not under TP: see
        # _gather_native).
        self.native_copies = (fused and pool_sharding is None and NATIVE_PAGE_COPIES
                              and native.available())
        gather = _gather_native if self.native_copies else _gather
        scatter = (functools.partial(_scatter_from_host, scatter=_scatter_native)
                   if self.native_copies else _scatter_from_host if fused else _scatter)
        self._gather = jax.jit(gather, out_shardings=gather_out)
        self._scatter = jax.jit(scatter, donate_argnums=(0,), out_shardings=pool_sharding or (
            device_sharding if fused else None))

    @property
    def host_operands(self) -> bool:
        """Whether the separate gather/scatter programs take and return host pages
        (``fused``, and ``in_step``'s fallback for copies the step does not take)."""
        return self.copy_mode in HOST_OPERAND_MODES

    @property
    def max_pages(self) -> int:
        return self.buckets[-1]

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        """(start, bucket) pieces covering ``n`` pages exactly: the largest bucket that
        fits, again and again (1 is a bucket, so nothing is ever padded)."""
        out, start = [], 0
        while start < n:
            bucket = max(b for b in self.buckets if b <= n - start)
            out.append((start, bucket))
            start += bucket
        return out

    def gather(self, pool: jax.Array, page_ids: list[int]) -> list[jax.Array]:
        """One array per page id, in order (dispatched, not waited for): device staging
        pages, or in fused mode the host pages themselves."""
        out: list[jax.Array] = []
        for start, bucket in self._chunks(len(page_ids)):
            out.extend(self._gather(pool, np.asarray(page_ids[start:start + bucket], np.int32)))
        return out

    def to_host(self, pool: jax.Array, page_ids: list[int]) -> list[jax.Array]:
        """Host page arrays holding ``pool[page_ids]``, dispatched, not waited for."""
        pages = self.gather(pool, page_ids)
        if self.host_operands or not pages:
            return pages
        return list(jax.device_put(pages, self.host_sharding))

    def to_device(self, host_pages: list[jax.Array]) -> list[jax.Array]:
        """What ``scatter`` later lands for these host pages: device copies issued now
        (``device_put`` mode), or the host pages themselves (fused: the scatter copies)."""
        if self.host_operands or not host_pages:
            return list(host_pages)
        return list(jax.device_put(host_pages, self.device_sharding))

    def scatter(self, pool: jax.Array, page_ids: list[int],
                pages: list[jax.Array]) -> jax.Array:
        """Write ``pages[i]`` (from ``to_device``) to ``pool[page_ids[i]]``; ``pool`` is
        donated."""
        if len(page_ids) != len(pages):
            raise ValueError(f"{len(page_ids)} page ids for {len(pages)} pages")
        for start, bucket in self._chunks(len(page_ids)):
            pool = self._scatter(pool, np.asarray(page_ids[start:start + bucket], np.int32),
                                 tuple(pages[start:start + bucket]))
        return pool

    def compile_ahead(self, pool: jax.ShapeDtypeStruct, bucket: int) -> None:
        """Compile one bucket's gather and scatter from an abstract pool, on any thread:
        ``warmup`` and the copies then find them compiled (JAX's caches are shared), so
        the thread that owns the pool does not compile them."""
        ids = np.full(bucket, NULL_PAGE, np.int32)
        self._gather.lower(pool, ids).compile()
        sharding = self.host_sharding if self.host_operands else self.device_sharding
        page = jax.ShapeDtypeStruct(pool.shape[1:], pool.dtype, sharding=sharding)
        self._scatter.lower(pool, ids, (page,) * bucket).compile()

    def warmup(self, pool: jax.Array) -> jax.Array:
        """Compile every bucket and both copies now (reads and rewrites the null page)."""
        for bucket in self.buckets:
            ids = np.full(bucket, NULL_PAGE, np.int32)
            pool = self._scatter(pool, ids, self._gather(pool, ids))
        pages = self.to_device(self.to_host(pool, [NULL_PAGE]))
        pool = self.scatter(pool, [NULL_PAGE], pages)
        jax.block_until_ready(pool)
        return pool
