"""DuplexKV: full-duplex asynchronous page rotation between device and pinned host memory.

``rotation.DuplexKV`` is the rotation engine (its docstring says how every ordering is
guaranteed); ``mover.PageMover`` holds the jitted, bucketed page gather and scatter.
Bookkeeping lives in ``superinfer_jax.kv.two_tier``, host arrays in ``kv.host_pool``.
"""

from superinfer_jax.duplexkv.mover import PageMover, staging_buckets
from superinfer_jax.duplexkv.rotation import DuplexKV, EventKind, RotationEvent
from superinfer_jax.duplexkv.stats import TransferStats

__all__ = ["DuplexKV", "EventKind", "PageMover", "RotationEvent", "TransferStats",
           "staging_buckets"]
