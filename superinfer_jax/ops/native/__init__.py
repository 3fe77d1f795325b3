"""Native CPU ops as typed XLA FFI custom calls, compiled from C++ source here.

Why: XLA:CPU compiles gathers and dynamic slices to loops of scalar moves (about 5 GB/s),
and the paged attention's page gather was most of a batch-32 decode step's attention
(see ``kv_gather.cc``). A memcpy per head-row, in the order the pool stores them, on the
caller's and XLA's intra-op threads, is the same bytes at memory speed. XLA fills a
zeroed KV pool by faulting in and writing every page of it, seconds of a server's start
for a pool the kernel can hand out as zero pages for free (``lazy_zeros.cc``). XLA's
bfloat16 dot streamed a decode step's weights at about half the memory's speed
(``bf16_matmul.cc``, AVX512-BF16 CPUs only; batch-invariant by construction). A decode
step's attention ran as a loop of a dozen thunks per block of pages, every row padded to
the longest context (``decode_attention.cc``, AVX-512F). And DuplexKV's page copies ran as
XLA loops with regular stores (``page_copy.cc``: one non-temporal copy per page).

The library is built from the ``.cc`` files here with the system C++ compiler (``$CXX``,
else ``g++``) against the FFI headers that ship in jaxlib, on first use or ahead of time by
``python -m superinfer_jax.ops.native`` (``make install`` runs it). The result is cached
under ``$SUPERINFER_NATIVE_CACHE`` (default ``~/.cache/superinfer_jax/native``), named by
a hash of the source, the compile command and jaxlib's version, and written to a
temporary file then renamed, so parallel builders (test workers) never load half a file.
No flag targets the build CPU: memcpy is glibc's, which picks its code per CPU at run
time, and the matmul's AVX512-BF16 functions are compiled by attribute and called only
where the CPU reports that ISA, so a cache copied to another x86-64 machine still runs.

Where no compiler is found, the build fails, or ``SUPERINFER_NATIVE_OPS=0`` is set, the
callers use their plain-XLA paths (byte-identical results for the copies and the zeros,
equal to float32 rounding for the matmul and the attention; slower); the reason is
logged once. Only the CPU platform gets the custom calls: their callers select them with
``jax.lax.platform_dependent``, so a program lowered for CUDA never contains them, and
the pool's lazy zeros are used only when the pool's device is a CPU.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from superinfer_jax.local_cache import cache_root, switched_on

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("kv_gather.cc", "lazy_zeros.cc", "bf16_matmul.cc",
                             "decode_attention.cc", "page_copy.cc"))
HEADERS = (Path(__file__).with_name("parallel_chunks.h"),)  # included by SOURCES
KV_GATHER_TARGET = "superinfer_kv_gather"
LAZY_ZEROS_TARGET = "superinfer_lazy_zeros"
BF16_MATMUL_TARGET = "superinfer_bf16_matmul"
DECODE_ATTENTION_TARGET = "superinfer_decode_attention"
PAGE_GATHER_TARGET = "superinfer_page_gather"
PAGE_SCATTER_TARGET = "superinfer_page_scatter"
_TARGETS = {PAGE_GATHER_TARGET: "SuperinferPageGather",
            PAGE_SCATTER_TARGET: "SuperinferPageScatter",
            KV_GATHER_TARGET: "SuperinferKvGather", LAZY_ZEROS_TARGET: "SuperinferLazyZeros",
            BF16_MATMUL_TARGET: "SuperinferBf16Matmul",
            DECODE_ATTENTION_TARGET: "SuperinferDecodeAttention"}
_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-w")
_DISABLE_ENV = "SUPERINFER_NATIVE_OPS"
_CACHE_ENV = "SUPERINFER_NATIVE_CACHE"


class NativeBuildError(RuntimeError):
    """The library could not be built or loaded; the message says why."""


def enabled() -> bool:
    """False when ``SUPERINFER_NATIVE_OPS`` is ``0``, ``false``, ``no`` or ``off``."""
    return switched_on(_DISABLE_ENV)


def cache_dir() -> Path:
    return Path(os.environ.get(_CACHE_ENV) or cache_root() / "native")


def _compiler() -> list[str]:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise NativeBuildError("no C++ compiler: set CXX or install g++")
    return shlex.split(cxx)


def library_path() -> Path:
    """Where the library for this source, compile command and jaxlib lives."""
    import jaxlib

    digest = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    digest.update(" ".join(_compiler() + list(_FLAGS)).encode())
    digest.update(jaxlib.__version__.encode())
    return cache_dir() / f"native_ops-{digest.hexdigest()[:16]}.so"


def build() -> Path:
    """The library's path, compiled first unless already cached."""
    target = library_path()
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        cmd = [*_compiler(), *_FLAGS, f"-I{jax.ffi.include_dir()}", *map(str, SOURCES),
               "-o", str(partial)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise NativeBuildError(f"{shlex.join(cmd)}: {e}") from e
        if done.returncode != 0:
            raise NativeBuildError(f"{shlex.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.replace(partial, target)
    log.info("built native CPU ops: %s", target)
    return target


_bf16_supported = False
_attention_supported = False


@functools.cache
def _register() -> str | None:
    """Build, load and register the custom call once per process; the library's path, or
    None (with the reason logged) when the plain-XLA path must be used."""
    if not enabled():
        log.info("native CPU ops off (%s=0): plain XLA page gathers", _DISABLE_ENV)
        return None
    try:
        path = build()
        library = ctypes.cdll.LoadLibrary(str(path))
        handlers = {target: getattr(library, symbol) for target, symbol in _TARGETS.items()}
    except (NativeBuildError, OSError, AttributeError) as e:
        log.warning("native CPU ops unavailable, using XLA's gather and fill (slower): %s", e)
        return None
    for target, handler in handlers.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
    global _bf16_supported, _attention_supported
    _bf16_supported = bool(library.SuperinferBf16MatmulSupported())
    _attention_supported = bool(library.SuperinferDecodeAttentionSupported())
    log.info("native CPU ops: %s (bfloat16 matmul: %s; decode attention: %s)", path,
             "AVX512-BF16" if _bf16_supported else "off, this CPU lacks AVX512-BF16",
             "AVX-512" if _attention_supported else "off, this CPU lacks AVX-512")
    return str(path)


def available() -> bool:
    """Whether the native CPU ops are registered (building them on first call)."""
    return _register() is not None


def bf16_matmul_available() -> bool:
    """Whether ``bf16_matmul`` may be used: the ops are registered and this CPU has
    AVX512-BF16. Fixed for the process, so a model takes one path for every shape."""
    return _register() is not None and _bf16_supported


def decode_attention_available() -> bool:
    """Whether ``decode_attention`` may be used: the ops are registered and this CPU has
    AVX-512F."""
    return _register() is not None and _attention_supported


DECODE_ATTENTION_HEAD_DIMS = (16, 32, 64, 128, 256)


def fingerprint() -> str:
    """What a compiled program using these ops depends on, for executable caches: the
    library file and which CPU-dependent kernels it runs here (bfloat16 matmul, decode
    attention), or ``off``. Registers the custom calls, so that an executable loaded from a
    cache (without tracing) finds its targets."""
    path = _register()
    if not path:
        return "off"
    return (Path(path).name + ("+bf16mm" if _bf16_supported else "")
            + ("+attn" if _attention_supported else ""))


def gather_kv(pool: jax.Array, ids: jax.Array, layer: int) -> tuple[jax.Array, jax.Array]:
    """``pool[ids, layer, kv]`` with heads first, for K and V, through the custom call.

    pool [N, L, 2, S, K, D]; ids [B, P] (clamped to [0, N)); returns two [B, K, P, S, D]
    arrays in the pool's dtype, equal byte for byte to
    ``pool[ids[:, None, :], layer, kv, :, arange(K)[None, :, None]]``. CPU only: call it
    from a ``jax.lax.platform_dependent`` branch after ``available()``.
    """
    _, num_layers, two, page_size, kv_heads, head_dim = pool.shape
    if two != 2 or not 0 <= layer < num_layers:
        raise ValueError(f"gather_kv: pool {pool.shape} and layer {layer} do not match")
    batch, pages = ids.shape
    out = jax.ShapeDtypeStruct((batch, kv_heads, pages, page_size, head_dim), pool.dtype)
    call = jax.ffi.ffi_call(KV_GATHER_TARGET, (out, out))
    k, v = call(pool, ids.astype(np.int32), layer=np.int64(layer))
    return k, v


def lazy_zeros(shape: tuple[int, ...], dtype: jax.typing.DTypeLike) -> jax.Array:
    """An all-zero array whose memory is not written now: large page-aligned spans are
    released to the kernel (``madvise``), which maps zero pages until they are first
    written, so the cost of a zeroed KV pool moves from start-up to the pages' first
    writes. Byte-identical to ``jnp.zeros``. CPU only, one device (call it inside
    ``jax.jit`` after ``available()``): a sharded pool keeps XLA's fill."""
    out = jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype))
    return jax.ffi.ffi_call(LAZY_ZEROS_TARGET, out)()


MAX_MATMUL_WEIGHTS = 4  # kMaxWeights in bf16_matmul.cc


def bf16_matmuls(x: jax.Array, weights: Sequence[jax.Array]) -> list[jax.Array]:
    """``[x @ w for w in weights]`` for bfloat16 x [M, K] and 1-4 bfloat16 w [K, N_i],
    float32 results [M, N_i], in one custom call (``bf16_matmul.cc``): the threads split
    every weight's columns at once, one wait per call. Each output is one float32 sum over
    k in increasing pairs, whatever M, so a row's bits never depend on its batch. CPU only:
    call it from a ``jax.lax.platform_dependent`` branch after ``bf16_matmul_available()``.
    """
    if not 1 <= len(weights) <= MAX_MATMUL_WEIGHTS:
        raise ValueError(f"bf16_matmuls: 1 to {MAX_MATMUL_WEIGHTS} weights, got {len(weights)}")
    for w in weights:
        if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
            raise ValueError(f"bf16_matmul: x {x.shape} and w {w.shape} do not chain")
        if x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16:
            raise ValueError(f"bf16_matmul: x and w must be bfloat16, got {x.dtype}, {w.dtype}")
    outs = [jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), np.float32) for w in weights]
    return list(jax.ffi.ffi_call(BF16_MATMUL_TARGET, outs)(x, *weights))


def bf16_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w`` through ``bf16_matmuls`` (one weight)."""
    return bf16_matmuls(x, [w])[0]


def decode_attention(q: jax.Array, pool: jax.Array, page_tables: jax.Array,
                     context_lens: jax.Array, layer: int, scale: float) -> jax.Array:
    """One query token per row against its paged keys and values, through the custom call
    (``decode_attention.cc``): q [B, H, D] float32, pool [N, L, 2, S, K, D] float32,
    page_tables [B, P] (clamped to [0, N)), context_lens [B] (keys [0, len) are visible;
    the row's own new key included) -> [B, H, D] float32; a row with no context gives
    zeros. Each row alone, so its result does not depend on the batch. CPU only: call it
    from a ``jax.lax.platform_dependent`` branch after ``decode_attention_available()``."""
    batch, heads, head_dim = q.shape
    _, num_layers, two, _, kv_heads, pool_dim = pool.shape
    if two != 2 or pool_dim != head_dim or heads % kv_heads or not 0 <= layer < num_layers:
        raise ValueError(f"decode_attention: q {q.shape}, pool {pool.shape} and layer {layer} "
                         "do not match")
    if head_dim not in DECODE_ATTENTION_HEAD_DIMS:
        raise ValueError(f"decode_attention: head_dim {head_dim} not in "
                         f"{DECODE_ATTENTION_HEAD_DIMS}")
    if q.dtype != jnp.float32 or pool.dtype != jnp.float32:
        raise ValueError(f"decode_attention: q and pool must be float32, got {q.dtype}, "
                         f"{pool.dtype}")
    out = jax.ShapeDtypeStruct(q.shape, np.float32)
    call = jax.ffi.ffi_call(DECODE_ATTENTION_TARGET, out)
    return call(q, pool, page_tables.astype(np.int32), context_lens.astype(np.int32),
                layer=np.int64(layer), scale=np.float32(scale))


def gather_pages(pool: jax.Array, ids: jax.Array) -> tuple[jax.Array, ...]:
    """``tuple(pool[ids[i]] for i)`` (ids [B], clamped to [0, N)) through the custom call
    (``page_copy.cc``): one streaming copy per page, byte-exact. CPU only: call it from a
    ``jax.lax.platform_dependent`` branch after ``available()``."""
    if ids.ndim != 1:
        raise ValueError(f"gather_pages: ids must be [B], got {ids.shape}")
    page = jax.ShapeDtypeStruct(pool.shape[1:], pool.dtype)
    call = jax.ffi.ffi_call(PAGE_GATHER_TARGET, [page] * ids.shape[0])
    return tuple(call(pool, ids.astype(np.int32)))


def scatter_pages(pool: jax.Array, ids: jax.Array, pages: Sequence[jax.Array]) -> jax.Array:
    """``pool`` with ``pool[ids[i]] = pages[i]`` (ids clamped; a repeated id: the later
    page wins), in place (the result aliases ``pool``: donate it), through the custom call
    (``page_copy.cc``): one streaming copy per page, byte-exact. CPU only: call it from a
    ``jax.lax.platform_dependent`` branch after ``available()``."""
    if ids.ndim != 1 or ids.shape[0] != len(pages):
        raise ValueError(f"scatter_pages: {ids.shape} ids for {len(pages)} pages")
    for page in pages:
        if page.shape != pool.shape[1:] or page.dtype != pool.dtype:
            raise ValueError(f"scatter_pages: page {page.shape} {page.dtype} is not a page of "
                             f"pool {pool.shape} {pool.dtype}")
    call = jax.ffi.ffi_call(PAGE_SCATTER_TARGET, jax.ShapeDtypeStruct(pool.shape, pool.dtype),
                            input_output_aliases={0: 0})
    return call(pool, ids.astype(np.int32), *pages)
