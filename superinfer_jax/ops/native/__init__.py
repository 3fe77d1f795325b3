"""Native CPU ops as typed XLA FFI custom calls, compiled from C++ source here.

Why: XLA:CPU compiles gathers and dynamic slices to loops of scalar moves, so the paged
attention's page gather (``kv_gather.cc``) and DuplexKV's page copies (``page_copy.cc``,
non-temporal stores) are memcpys here; a zeroed KV pool is handed out as kernel zero
pages instead of written (``lazy_zeros.cc``); the bf16 decode matmul streams weights at
memory speed (``bf16_matmul.cc``, AVX512-BF16, batch-invariant), and int8 / fp8 e4m3
weights at one byte each (``quant_matmul.cc``, the same tiles and guarantees; with
``SUPERINFER_NATIVE_AMX=1`` on an AMX-BF16 CPU both take AMX tiles for every M,
``amx_tiles.h``); int8 weights times per-token int8 activations sum exactly in int32
(``w8a8_matmul.cc``, AVX512-VNNI, and AMX-INT8 from a few rows with the same bits); decode
attention reads each row's own pages once (``decode_attention.cc``, AVX-512F); a
mixture-of-experts layer's grouped matmul streams only the experts its rows are routed to
(``grouped_matmul.cc``, AVX-512F / AVX512-BF16, batch-invariant).

Built with ``$CXX`` (else ``g++``) against jaxlib's FFI headers, on first use or by
``python -m superinfer_jax.ops.native``; cached under ``$SUPERINFER_NATIVE_CACHE`` by a
hash of source, command and jaxlib, written then renamed (parallel builders are safe).
No flag targets the build CPU, so a cache runs on any x86-64. Without a compiler, on a
failed build, or with ``SUPERINFER_NATIVE_OPS=0``, callers take their XLA paths (the same
bytes for copies and zeros, float32 rounding for matmul and attention). Every call is
CPU only: callers select it in a ``jax.lax.platform_dependent`` branch after
``available()`` (or the kernel's own check). Page ids are clamped to ``[0, N)``.
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
                             "decode_attention.cc", "page_copy.cc", "quant_matmul.cc",
                             "grouped_matmul.cc", "w8a8_matmul.cc"))
HEADERS = tuple(Path(__file__).with_name(name)  # included by SOURCES
                for name in ("parallel_chunks.h", "bf16_tiles.h", "column_split.h",
                             "amx_tiles.h"))
KV_GATHER_TARGET = "superinfer_kv_gather"
LAZY_ZEROS_TARGET = "superinfer_lazy_zeros"
BF16_MATMUL_TARGET = "superinfer_bf16_matmul"
QUANT_MATMUL_TARGET = "superinfer_quant_matmul"
DECODE_ATTENTION_TARGET = "superinfer_decode_attention"
PAGE_GATHER_TARGET = "superinfer_page_gather"
PAGE_SCATTER_TARGET = "superinfer_page_scatter"
GROUPED_MATMUL_TARGET = "superinfer_grouped_matmul"
W8A8_MATMUL_TARGET = "superinfer_w8a8_matmul"
_TARGETS = {PAGE_GATHER_TARGET: "SuperinferPageGather",
            PAGE_SCATTER_TARGET: "SuperinferPageScatter",
            KV_GATHER_TARGET: "SuperinferKvGather", LAZY_ZEROS_TARGET: "SuperinferLazyZeros",
            BF16_MATMUL_TARGET: "SuperinferBf16Matmul",
            QUANT_MATMUL_TARGET: "SuperinferQuantMatmul",
            DECODE_ATTENTION_TARGET: "SuperinferDecodeAttention",
            GROUPED_MATMUL_TARGET: "SuperinferGroupedMatmul",
            W8A8_MATMUL_TARGET: "SuperinferW8a8Matmul"}
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
_quant_supported = False
_matmul_amx = False
_w8a8_supported = False
_w8a8_amx = False
_attention_supported = False
_grouped_supported: frozenset[str] = frozenset()  # the dtypes grouped_matmul runs here


@functools.cache
def _register() -> str | None:
    """Build, load and register the custom calls once per process; the library's path, or
    None (the reason logged)."""
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
    global _bf16_supported, _quant_supported, _attention_supported, _grouped_supported
    global _matmul_amx, _w8a8_supported, _w8a8_amx
    _bf16_supported = bool(library.SuperinferBf16MatmulSupported())
    _matmul_amx = _bf16_supported and bool(library.SuperinferMatmulUsesAmx())
    _quant_supported = bool(library.SuperinferQuantMatmulSupported())
    _w8a8_supported = bool(library.SuperinferW8a8MatmulSupported())
    _w8a8_amx = _w8a8_supported and bool(library.SuperinferW8a8UsesAmx())
    _attention_supported = bool(library.SuperinferDecodeAttentionSupported())
    _grouped_supported = frozenset(
        name for code, name in enumerate(GROUPED_MATMUL_DTYPES)
        if library.SuperinferGroupedMatmulSupported(code))
    if os.environ.get("SUPERINFER_NATIVE_AMX") == "1" and _bf16_supported and not _matmul_amx:
        log.warning("SUPERINFER_NATIVE_AMX=1, but this CPU lacks AMX-BF16 or Linux refused "
                    "the tile state: the matmuls take the AVX512-BF16 register tiles")
    log.info("native CPU ops: %s (bfloat16 matmul: %s; decode attention: %s)", path,
             ("AMX" if _matmul_amx else "AVX512-BF16") if _bf16_supported
             else "off, this CPU lacks AVX512-BF16",
             "AVX-512" if _attention_supported else "off, this CPU lacks AVX-512")
    return str(path)


def available() -> bool:
    """Whether the native CPU ops are registered (building them on first call)."""
    return _register() is not None


def bf16_matmul_available() -> bool:
    """Whether ``bf16_matmul`` may be used (registered, AVX512-BF16 and AVX512-VBMI); fixed
    per process."""
    return _register() is not None and _bf16_supported


def quant_matmul_available() -> bool:
    """Whether ``quant_matmuls`` may be used (registered, AVX512-BF16 and AVX512-VBMI)."""
    return _register() is not None and _quant_supported


def w8a8_matmul_available() -> bool:
    """Whether ``w8a8_matmuls`` may be used (registered, AVX512-VNNI)."""
    return _register() is not None and _w8a8_supported


def w8a8_tiles() -> str | None:
    """What ``w8a8_matmuls`` runs on from a few rows: ``"amx"`` (AMX-INT8, unless
    ``SUPERINFER_NATIVE_AMX=0``) or ``"avx512"`` (AVX512-VNNI register tiles, also every
    call below a few rows); None where it does not run. The same bits either way."""
    if not w8a8_matmul_available():
        return None
    return "amx" if _w8a8_amx else "avx512"


def matmul_tiles() -> str | None:
    """Which tiles ``bf16_matmuls`` and ``quant_matmuls`` run in this process: ``"amx"``
    (``SUPERINFER_NATIVE_AMX=1`` on an AMX-BF16 CPU), ``"avx512"`` (AVX512-BF16 register
    tiles), or None where neither runs. Fixed per process: the two give different bits,
    so one process never mixes them."""
    if not bf16_matmul_available():
        return None
    return "amx" if _matmul_amx else "avx512"


def decode_attention_available() -> bool:
    """Whether ``decode_attention`` may be used (registered, AVX-512F)."""
    return _register() is not None and _attention_supported


DECODE_ATTENTION_HEAD_DIMS = (16, 32, 64, 128, 256)
GROUPED_MATMUL_DTYPES = ("bfloat16", "float32")  # codes 0, 1 in grouped_matmul.cc


def grouped_matmul_available(dtype: jax.typing.DTypeLike) -> bool:
    """Whether ``grouped_matmul`` runs ``dtype`` operands here (registered, AVX-512F, and
    AVX512-BF16 for bfloat16); fixed per process."""
    return _register() is not None and np.dtype(dtype).name in _grouped_supported


def fingerprint() -> str:
    """What a compiled program using these ops depends on, for executable caches (and
    registers the calls, for an executable loaded without tracing)."""
    path = _register()
    if not path:
        return "off"
    return (Path(path).name + ("+bf16mm" if _bf16_supported else "")
            + ("+amx" if _matmul_amx else "") + ("+w8a8" if _w8a8_supported else "")
            + ("+attn" if _attention_supported else "")
            + "".join(f"+gmm-{d}" for d in sorted(_grouped_supported)))


def gather_kv(pool: jax.Array, ids: jax.Array, layer: int) -> tuple[jax.Array, jax.Array]:
    """``pool[ids, layer, kv]`` with heads first, for K and V: two [B, K, P, S, D] arrays,
    byte for byte ``pool[ids[:, None, :], layer, kv, :, arange(K)[None, :, None]]``.
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
    """An all-zero array whose memory is not written now (``madvise``: the kernel maps
    zero pages until first written). One CPU device; a sharded pool keeps XLA's fill."""
    out = jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype))
    return jax.ffi.ffi_call(LAZY_ZEROS_TARGET, out)()


MAX_MATMUL_WEIGHTS = 4  # kMaxSplitWeights in column_split.h
ROW_DTYPES = (jnp.bfloat16, jnp.float32)  # the matmuls' x (float32: rounded in the call)


def matmul_rows(x: jax.Array) -> jax.Array:
    """``x`` as ``bf16_matmuls`` and ``quant_matmuls`` take it: itself when bfloat16 or
    float32 (which the call rounds), else cast to bfloat16 here."""
    return x if x.dtype in ROW_DTYPES else x.astype(jnp.bfloat16)


def bf16_matmuls(x: jax.Array, weights: Sequence[jax.Array]) -> list[jax.Array]:
    """``[x @ w for w in weights]`` for x [M, K] and 1-4 bfloat16 w [K, N_i], float32
    out, in one call; a row's bits never depend on its batch. x is bfloat16, or float32
    that the call rounds to bfloat16 (to nearest even, as ``x.astype(bfloat16)`` would:
    the same results, without an XLA op before the call)."""
    if not 1 <= len(weights) <= MAX_MATMUL_WEIGHTS:
        raise ValueError(f"bf16_matmuls: 1 to {MAX_MATMUL_WEIGHTS} weights, got {len(weights)}")
    for w in weights:
        if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
            raise ValueError(f"bf16_matmul: x {x.shape} and w {w.shape} do not chain")
        if x.dtype not in ROW_DTYPES or w.dtype != jnp.bfloat16:
            raise ValueError(f"bf16_matmul: x must be bfloat16 or float32 and w bfloat16, "
                             f"got {x.dtype}, {w.dtype}")
    outs = [jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), np.float32) for w in weights]
    return list(jax.ffi.ffi_call(BF16_MATMUL_TARGET, outs)(x, *weights))


def bf16_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w`` through ``bf16_matmuls`` (one weight)."""
    return bf16_matmuls(x, [w])[0]


QUANT_WEIGHT_DTYPES = (jnp.int8, jnp.float8_e4m3fn)


QUANT_PANEL = 256
"""The storage panel (columns) ``models.quant`` packs one-device weights into for the
native kernel: one register tile's width at batch 1, so a tile streams one block."""


def quant_matmuls(x: jax.Array, weights: Sequence[tuple[jax.Array, jax.Array]],
                  panel: int = 0) -> list[jax.Array]:
    """``[(x @ q) * s for q, s in weights]`` for x [M, K] (bfloat16, or float32 rounded
    to it in the call, as ``bf16_matmuls`` does), 1-4 one-byte q
    [K, N_i] (all int8 or all float8_e4m3fn) and float32 per-column scales s [N_i];
    float32 out, in one call (the kernel: ``quant_matmul.cc``). ``panel``: 0 for
    row-major q, else the width of the column panels q is packed in (a multiple of 32;
    ``models.quant.pack_columns``). A row's bits never depend on its batch, nor on the
    packing; needs ``quant_matmul_available()``."""
    if panel < 0 or panel % 32:
        raise ValueError(f"quant_matmul: panel must be 0 or a multiple of 32, got {panel}")
    if not 1 <= len(weights) <= MAX_MATMUL_WEIGHTS:
        raise ValueError(f"quant_matmuls: 1 to {MAX_MATMUL_WEIGHTS} weights, got {len(weights)}")
    if x.ndim != 2 or x.dtype not in ROW_DTYPES:
        raise ValueError(f"quant_matmul: x must be bfloat16 or float32 [M, K], got {x.dtype} "
                         f"{x.shape}")
    if len({q.dtype for q, _ in weights}) != 1:
        raise ValueError("quant_matmul: the weights of one call share a dtype")
    for q, s in weights:
        if q.ndim != 2 or x.shape[1] != q.shape[0] or s.shape != (q.shape[1],):
            raise ValueError(f"quant_matmul: x {x.shape}, w {q.shape} and scale {s.shape} "
                             "do not chain")
        if q.dtype not in QUANT_WEIGHT_DTYPES or s.dtype != jnp.float32:
            raise ValueError(f"quant_matmul: w must be int8 or float8_e4m3fn and scale "
                             f"float32, got {q.dtype}, {s.dtype}")
    outs = [jax.ShapeDtypeStruct((x.shape[0], q.shape[1]), np.float32) for q, _ in weights]
    flat = [a for pair in weights for a in pair]
    return list(jax.ffi.ffi_call(QUANT_MATMUL_TARGET, outs)(x, *flat, panel=np.int64(panel)))


W8A8_BLOCK = 64
"""The column block ``models.quant.pack_w8a8`` stores W8A8 weights in (``w8a8_matmul.cc``)."""


def w8a8_matmuls(x: jax.Array, weights: Sequence[tuple[jax.Array, jax.Array]],
                 rotation: int = 1) -> list[jax.Array]:
    """``[(x_q @ q) * s_x * s for q, s in weights]`` for x [M, K] float32 or bfloat16,
    rotated by the Hadamard transform in blocks of ``rotation`` (a power of two dividing
    K; 1: none) and quantized per row in the call (``x_q`` int8, ``s_x`` its scale;
    ``models.quant.quantize_rows``), 1-4 weights q
    [K, N_i] as ``models.quant.pack_w8a8`` stores them (uint8) and float32 per-column
    scales s [N_i]; float32 out, in one call (``w8a8_matmul.cc`` gives the exact rule).
    The sums are exact int32, so a row's bits never depend on its batch nor on which
    tiles ran; needs ``w8a8_matmul_available()``."""
    if not 1 <= len(weights) <= MAX_MATMUL_WEIGHTS:
        raise ValueError(f"w8a8_matmuls: 1 to {MAX_MATMUL_WEIGHTS} weights, got {len(weights)}")
    if x.ndim != 2 or x.dtype not in ROW_DTYPES or x.shape[1] % 4:
        raise ValueError(f"w8a8_matmul: x must be bfloat16 or float32 [M, K] with K a "
                         f"multiple of 4, got {x.dtype} {x.shape}")
    if rotation < 1 or rotation & (rotation - 1) or x.shape[1] % rotation:
        raise ValueError(f"w8a8_matmul: rotation must be a power of two dividing K "
                         f"{x.shape[1]}, got {rotation}")
    for q, s in weights:
        if q.ndim != 2 or x.shape[1] != q.shape[0] or s.shape != (q.shape[1],):
            raise ValueError(f"w8a8_matmul: x {x.shape}, w {q.shape} and scale {s.shape} "
                             "do not chain")
        if q.dtype != jnp.uint8 or s.dtype != jnp.float32:
            raise ValueError(f"w8a8_matmul: w must be uint8 (models.quant.pack_w8a8) and "
                             f"scale float32, got {q.dtype}, {s.dtype}")
    outs = [jax.ShapeDtypeStruct((x.shape[0], q.shape[1]), np.float32) for q, _ in weights]
    flat = [a for pair in weights for a in pair]
    return list(jax.ffi.ffi_call(W8A8_MATMUL_TARGET, outs)(x, *flat,
                                                          rotation=np.int64(rotation)))


def decode_attention(q: jax.Array, pool: jax.Array, page_tables: jax.Array,
                     context_lens: jax.Array, layer: int, scale: float) -> jax.Array:
    """One float32 query token per row against keys ``[0, context_lens[b])`` of its pages
    -> [B, H, D] float32 (zeros without context); each row alone, batch-invariant."""
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
    """``tuple(pool[ids[i]] for i)``: one streaming copy per page, byte-exact."""
    if ids.ndim != 1:
        raise ValueError(f"gather_pages: ids must be [B], got {ids.shape}")
    page = jax.ShapeDtypeStruct(pool.shape[1:], pool.dtype)
    call = jax.ffi.ffi_call(PAGE_GATHER_TARGET, [page] * ids.shape[0])
    return tuple(call(pool, ids.astype(np.int32)))


def scatter_pages(pool: jax.Array, ids: jax.Array, pages: Sequence[jax.Array]) -> jax.Array:
    """``pool`` with ``pool[ids[i]] = pages[i]`` (a repeated id: the later page wins), in
    place (donate ``pool``): one streaming copy per page, byte-exact."""
    if ids.ndim != 1 or ids.shape[0] != len(pages):
        raise ValueError(f"scatter_pages: {ids.shape} ids for {len(pages)} pages")
    for page in pages:
        if page.shape != pool.shape[1:] or page.dtype != pool.dtype:
            raise ValueError(f"scatter_pages: page {page.shape} {page.dtype} is not a page of "
                             f"pool {pool.shape} {pool.dtype}")
    call = jax.ffi.ffi_call(PAGE_SCATTER_TARGET, jax.ShapeDtypeStruct(pool.shape, pool.dtype),
                            input_output_aliases={0: 0})
    return call(pool, ids.astype(np.int32), *pages)


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``[M, K] x [G, K, N]`` by ``group_sizes [G]`` -> float32 ``[M, N]``, ragged_dot's
    contract (``superinfer_jax.ops.grouped_matmul``): only the groups with rows are read,
    and a row's bits depend on its own values and its group's weight alone."""
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"grouped_matmul: lhs {lhs.shape} and rhs {rhs.shape} do not chain")
    if group_sizes.shape != (rhs.shape[0],):
        raise ValueError(f"grouped_matmul: group_sizes {group_sizes.shape} for "
                         f"{rhs.shape[0]} groups")
    if lhs.dtype != rhs.dtype or np.dtype(lhs.dtype).name not in GROUPED_MATMUL_DTYPES:
        raise ValueError(f"grouped_matmul: lhs and rhs must both be bfloat16 or both float32, "
                         f"got {lhs.dtype}, {rhs.dtype}")
    out = jax.ShapeDtypeStruct((lhs.shape[0], rhs.shape[2]), np.float32)
    return jax.ffi.ffi_call(GROUPED_MATMUL_TARGET, out)(lhs, rhs, group_sizes.astype(np.int32))
