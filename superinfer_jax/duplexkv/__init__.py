"""DuplexKV: full-duplex asynchronous page rotation between device and pinned host memory
(``rotation``: the engine and why it is race-free; ``mover``: the jitted page copies)."""

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
