"""Attention and KV-write ops over the paged pool, behind one backend switch.

``backend="xla"``: the plain XLA reference (the CPU default); ``"pallas"``: the Pallas
kernels (GPU, or interpret mode on CPU); ``"auto"``: Pallas on GPU, XLA elsewhere.
``write_and_attend`` is what a model layer calls. Under tensor parallelism it runs once
per shard inside ``jax.shard_map``, on that shard's KV heads and slice of the pool, so
no page crosses devices and the Pallas kernel sees local shapes.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from superinfer_jax.dist import parallel
from superinfer_jax.ops import attention_xla

BACKENDS = ("auto", "xla", "pallas")


def resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "pallas" if jax.default_backend() == "gpu" and _pallas_available() else "xla"
    return backend


def _pallas_available() -> bool:
    try:
        from superinfer_jax.ops import attention_pallas  # noqa: F401
    except ImportError:
        return False
    return True


def paged_attention(q, kv_pool, layer, page_tables, context_lens, query_lens, *, scale,
                    backend: str = "xla", soft_cap: float | None = None, kv_scales=None):
    """Causal paged attention; see ``attention_xla.paged_attention`` for the contract.
    ``kv_scales``: this layer's [2, K] fp8_e4m3 scales, or None (``kv.quant``)."""
    if backend == "pallas":
        from superinfer_jax.ops import attention_pallas

        return attention_pallas.paged_attention(
            q, kv_pool, layer, page_tables, context_lens, query_lens,
            scale=scale, soft_cap=soft_cap, kv_scales=kv_scales,
        )
    return attention_xla.paged_attention(
        q, kv_pool, layer, page_tables, context_lens, query_lens, scale=scale, soft_cap=soft_cap,
        kv_scales=kv_scales,
    )


write_kv = attention_xla.write_kv


def write_and_attend(q, k, v, kv_pool, layer, page_tables, positions, context_lens,
                     query_lens, *, scale, backend: str = "xla", mesh: Mesh | None = None,
                     kv_scales: jax.Array | None = None):
    """Write this step's K/V into the pool, then attend. Returns (out, kv_pool).

    q: [B, C, H, D]; k, v: [B, C, K, D]; kv_pool: [N, L, 2, S, K, D]; out: [B, C, H, D].
    ``kv_scales``: the [L, 2, K] scales of an fp8_e4m3 pool (``kv.quant``), else None.
    With a mesh, H and K are split over its ``tp`` axis (both must divide its size), and
    the scales with their heads.
    """
    local = functools.partial(_write_and_attend, layer=layer, scale=scale, backend=backend)
    if mesh is None:
        return local(q, k, v, kv_pool, page_tables, positions, context_lens, query_lens,
                     kv_scales)
    heads, pool, rep = parallel.HEADS_SPEC, parallel.POOL_SPEC, P()
    specs: tuple[P, ...] = (heads, heads, heads, pool, rep, rep, rep, rep)
    args: tuple[Any, ...] = (q, k, v, kv_pool, page_tables, positions, context_lens,
                             query_lens)
    if kv_scales is not None:
        specs, args = (*specs, parallel.KV_SCALES_SPEC), (*args, kv_scales)
    sharded = jax.shard_map(
        local, mesh=mesh, in_specs=specs, out_specs=(heads, pool),
        check_vma=False,  # pallas_call has no replication rule; every output is per shard
    )
    return sharded(*args)


def _write_and_attend(q, k, v, kv_pool, page_tables, positions, context_lens, query_lens,
                      kv_scales=None, *, layer, scale, backend):
    layer_scales = None if kv_scales is None else kv_scales[layer]  # [2, K]
    kv_pool = write_kv(kv_pool, layer, k, v, page_tables, positions, query_lens,
                       scales=layer_scales)
    out = paged_attention(q, kv_pool, layer, page_tables, context_lens, query_lens,
                          scale=scale, backend=backend, kv_scales=layer_scales)
    return out, kv_pool
