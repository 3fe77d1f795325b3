"""The device KV pool: how many pages it holds, where it lives, and its allocation on a
thread of its own (as tpu-inference's runner owns a KV cache manager)."""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable

import jax
from jax.sharding import Mesh

import superinfer_jax.ops.native as native
from superinfer_jax.config import EngineConfig
from superinfer_jax.config_schema import ConfigError
from superinfer_jax.dist import parallel
from superinfer_jax.duplexkv import DuplexKV
from superinfer_jax.kv.layout import PoolLayout

_CPU_DEFAULT_POOL_BYTES = 2 << 30
_GIB = 1 << 30


def choose_num_pages(config: EngineConfig, layout: PoolLayout) -> int:
    """``num_device_pages``, else ``kv_cache_memory_gb`` worth of pages of the KV dtype
    (its scale array counted), else what fits ``device_memory_fraction`` of the free
    device memory (a CPU reports none: a pool of at most 2 GiB); at least one request."""
    need_one = config.max_pages_per_seq + 1
    budget_gb = config.hardware.kv_cache_memory_gb
    if config.hardware.num_device_pages is not None:
        pages = config.hardware.num_device_pages
    elif budget_gb is not None:
        pages = (int(budget_gb * _GIB) - layout.scale_bytes) // layout.page_bytes
        if pages < need_one:
            raise ConfigError(
                "hardware.kv_cache_memory_gb",
                f"{budget_gb} GiB holds {max(pages, 0)} pages of {layout.page_bytes} bytes "
                f"({layout.dtype}), fewer than one request of max_model_len "
                f"{config.model.max_model_len} needs ({need_one} incl. the null page)")
    else:
        stats = jax.devices()[0].memory_stats() or {}
        if "bytes_limit" in stats:  # per device; a device holds 1/tp of each page
            free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
            shard_bytes = layout.page_bytes // config.model.tensor_parallel_size
            pages = int(free * config.hardware.device_memory_fraction) // shard_bytes
        else:
            want = config.engine.max_num_seqs * config.max_pages_per_seq + 1
            pages = min(want, _CPU_DEFAULT_POOL_BYTES // layout.page_bytes)
        pages = max(pages, need_one)
    if pages < need_one:
        raise ValueError(
            f"num_device_pages ({pages}) cannot hold one request of max_model_len "
            f"{config.model.max_model_len} ({need_one} pages incl. the null page)"
        )
    return pages


class DevicePool:
    """The zeroed pool of one engine, built on its own thread (zeroing can be seconds of
    CPU) beside the ready set's compiles; the first read of ``array`` waits for it.
    ``spec`` is the placement promised to the compiles: another is an error, not a
    recompile in the serving path."""

    def __init__(self, layout: PoolLayout, num_pages: int, mesh: Mesh | None,
                 duplex: DuplexKV | None):
        self.layout, self.num_pages, self.mesh, self.duplex = layout, num_pages, mesh, duplex
        self.spec = jax.ShapeDtypeStruct(layout.pool_shape(num_pages),
                                         layout.storage,
                                         sharding=self._sharding())
        self._array: jax.Array | None = None
        self._error: BaseException | None = None
        # Not a daemon: the interpreter joins it at exit. A daemon thread still inside
        # XLA's fill when a short script ends is torn down mid-call and aborts the process.
        self.thread = threading.Thread(target=self._allocate, name="kv-pool", daemon=False)
        if jax.process_count() == 1:
            self.thread.start()
        else:  # several processes issue their device programs in one order: inline
            self._allocate()

    @property
    def array(self) -> jax.Array:
        """The pool; the first read waits for the allocation (and raises its error)."""
        if self._array is None:
            if self.thread.ident is not None:
                self.thread.join()
            if self._error is not None:
                raise RuntimeError(f"allocating the KV pool failed: {self._error}"
                                   ) from self._error
            assert self._array is not None
        return self._array

    @array.setter
    def array(self, pool: jax.Array) -> None:
        self._array = pool

    def _allocate(self) -> None:
        try:
            pool = self.zeros()
            if self.duplex is not None:
                pool = self.duplex.adopt(pool)
            if pool.sharding != self.spec.sharding:
                raise RuntimeError(f"the pool is placed {pool.sharding}, its programs are "
                                   f"compiled for {self.spec.sharding}")
            self._array = pool
        except BaseException as e:  # raised by the first read of ``array``
            self._error = e

    def _sharding(self) -> jax.sharding.Sharding:
        """Where ``_allocate`` places the pool (known before it has run)."""
        if self.duplex is not None:
            return self.duplex.pool_sharding or self.duplex.host.device_sharding
        if self.mesh is None:
            return jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return parallel.pool_sharding(self.mesh)

    def zeros(self) -> jax.Array:
        """A zeroed pool, committed (an uncommitted array is another jit cache key, and
        the first real step would recompile a bucket warm-up compiled). Sharded, each
        device allocates only its own slice. With ``lazy`` the zeros come from the
        kernel: untouched pages cost nothing, where XLA's fill writes every page."""
        n, device = self.num_pages, jax.devices()[0]
        sharding = parallel.pool_sharding(self.mesh) if self.mesh is not None \
            else jax.sharding.SingleDeviceSharding(device)
        zeros: Callable[[], jax.Array] = functools.partial(self.layout.zeros, n)
        if self.lazy:
            zeros = functools.partial(native.lazy_zeros, self.layout.pool_shape(n),
                                      self.layout.storage)
        return jax.jit(zeros, out_shardings=sharding)()

    @property
    def lazy(self) -> bool:
        """Whether ``zeros`` comes from the kernel (one CPU device, native ops built)."""
        return (self.mesh is None and jax.devices()[0].platform == "cpu"
                and native.available())


def device_pool_key(config: EngineConfig) -> str:
    """The key that sized the device pool, for an error about its size."""
    hw = config.hardware
    if hw.num_device_pages is not None:
        return "hardware.num_device_pages"
    if hw.kv_cache_memory_gb is not None or not _accelerator_stats():
        return "hardware.kv_cache_memory_gb"  # on CPU, the key that sets the size
    return "hardware.device_memory_fraction"


def host_pool_key(config: EngineConfig) -> str:
    return ("duplex_kv.num_host_pages" if config.duplex_kv.num_host_pages is not None
            else "duplex_kv.host_memory_gb")


def available_host_bytes() -> int:
    """Memory the system can still give this process: ``MemAvailable`` (free plus
    reclaimable caches; ``sysconf``'s free pages where there is no ``/proc``), capped by
    the container's cgroup v2 limit less its use."""
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    meminfo = _read("/proc/meminfo")
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    limit, used = _read("/sys/fs/cgroup/memory.max"), _read("/sys/fs/cgroup/memory.current")
    if limit.strip().isdigit() and used.strip().isdigit():
        available = min(available, int(limit) - int(used))
    return available


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii") as f:
            return f.read()
    except OSError:
        return ""


def _accelerator_stats() -> dict[str, int]:
    """The first local device's memory stats where it reports a limit (GPU/TPU), else {}."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats if "bytes_limit" in stats else {}


def check_pools_fit(config: EngineConfig, layout: PoolLayout, device_pages: int,
                    host_pages: int) -> None:
    """Fail at start, naming the key, when the configured pools cannot fit: the device
    pool's shard in a device's free memory (an accelerator), the host tier (and on a CPU
    the device pool too, both host memory) in the memory available. A CPU commits its
    pools lazily as pages are first written, so without this check an oversized pool
    fails minutes into serving instead of at start."""
    device_bytes = device_pages * layout.page_bytes + layout.scale_bytes
    host_bytes = host_pages * layout.page_bytes
    stats = _accelerator_stats()
    in_host = host_bytes
    if stats:
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        shard = device_bytes // config.model.tensor_parallel_size
        if shard > free:
            raise ConfigError(device_pool_key(config),
                              f"the device KV pool needs {shard / _GIB:.2f} GiB per device, "
                              f"{free / _GIB:.2f} GiB is free")
    else:
        in_host += device_bytes
    available = available_host_bytes()
    if in_host <= available:
        return
    key = host_pool_key(config) if host_bytes > available or stats else \
        device_pool_key(config)
    where = f"device pool {device_bytes / _GIB:.2f} GiB + " if not stats else ""
    raise ConfigError(key, f"the KV pools need {in_host / _GIB:.2f} GiB of host memory "
                           f"({where}host tier {host_bytes / _GIB:.2f} GiB), "
                           f"{available / _GIB:.2f} GiB is available")


def check_backend_dtype(config: EngineConfig, backend: str) -> None:
    """fp8 pages on the Pallas path need a GPU with fp8 (compute capability 8.9+)."""
    dtype = config.model.kv_cache_dtype
    if backend != "pallas" or not dtype.startswith("fp8") or jax.default_backend() != "gpu":
        return
    capability = getattr(jax.local_devices()[0], "compute_capability", "0.0")
    if tuple(int(x) for x in str(capability).split(".")[:2]) < (8, 9):
        raise ConfigError("model.kv_cache_dtype",
                          f"{dtype} with the Pallas attention path needs a GPU with fp8 "
                          f"(compute capability 8.9+), this one is {capability}; use "
                          f"bfloat16, or hardware.attention_backend=xla")
