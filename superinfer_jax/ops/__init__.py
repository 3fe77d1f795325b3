"""Attention and KV-write ops over the paged pool, behind one backend switch.

``backend="xla"`` is the plain XLA reference (the CPU default); ``"pallas"`` selects the
Pallas kernels (GPU, or interpret mode on CPU); ``"auto"`` picks Pallas on GPU and XLA
elsewhere.
"""

from __future__ import annotations

import jax

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
                    backend: str = "xla", soft_cap: float | None = None):
    """Causal paged attention; see ``attention_xla.paged_attention`` for the contract."""
    if backend == "pallas":
        from superinfer_jax.ops import attention_pallas

        return attention_pallas.paged_attention(
            q, kv_pool, layer, page_tables, context_lens, query_lens,
            scale=scale, soft_cap=soft_cap,
        )
    return attention_xla.paged_attention(
        q, kv_pool, layer, page_tables, context_lens, query_lens, scale=scale, soft_cap=soft_cap
    )


write_kv = attention_xla.write_kv
