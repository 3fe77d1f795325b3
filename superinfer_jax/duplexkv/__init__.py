"""DuplexKV: full-duplex asynchronous page rotation between device and pinned host memory.

``rotation.DuplexKV`` is the rotation engine (its docstring says how every ordering is
guaranteed); ``mover.PageMover`` holds the jitted, bucketed page gather and scatter and
the copies to and from the host in the backend's copy mode (``device_put``, ``fused``,
or ``in_step``: inside the model step's own program, driven by ``ModelRunner``).
Bookkeeping lives in ``superinfer_jax.kv.two_tier``, host arrays in ``kv.host_pool``.
"""

from superinfer_jax.duplexkv.mover import (
    COPY_MODES,
    PageMover,
    default_copy_mode,
    staging_buckets,
)
from superinfer_jax.duplexkv.rotation import DuplexKV, EventKind, RotationEvent
from superinfer_jax.duplexkv.stats import TransferStats

__all__ = ["COPY_MODES", "DuplexKV", "EventKind", "PageMover", "RotationEvent",
           "TransferStats", "default_copy_mode", "staging_buckets"]
