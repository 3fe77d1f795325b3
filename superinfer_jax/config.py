"""Engine configuration: frozen dataclasses validated on construction.

Every error names the field, so a bad YAML key or CLI flag is found without a debugger.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from superinfer_jax.request import SLO

DTYPES = ("float32", "bfloat16")
ATTENTION_BACKENDS = ("auto", "xla", "pallas")


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _pow2_buckets(low: int, high: int) -> tuple[int, ...]:
    out, b = [], low
    while b < high:
        out.append(b)
        b *= 2
    out.append(high)
    return tuple(out)


@dataclass(frozen=True)
class EngineConfig:
    """How the engine lays out memory and batches work.

    Device pages: ``num_device_pages`` if set, else ``device_memory_fraction`` of the
    accelerator's free memory (where the backend reports it), else enough pages for
    ``max_num_seqs`` requests of ``max_model_len`` tokens.
    """

    page_size: int = 16
    num_device_pages: int | None = None
    device_memory_fraction: float = 0.9
    max_model_len: int = 2048
    max_num_seqs: int = 32  # most requests decoding in one step
    max_num_batched_tokens: int = 512  # token budget of one step (decode + prefill)
    max_prefill_chunk: int = 256  # longest prefill chunk of one request in one step
    max_prefill_rows: int = 4  # most requests prefilling in one step
    dtype: str = "float32"  # KV cache dtype
    attention_backend: str = "auto"
    default_slo: SLO = dataclasses.field(default_factory=SLO)
    seed: int = 0
    warmup: bool = True  # compile every bucket before serving
    compilation_cache_dir: str | None = None  # persistent XLA cache: later starts are fast
    show_progress: bool = True

    def __post_init__(self) -> None:
        for name in ("page_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                     "max_prefill_chunk", "max_prefill_rows"):
            _positive_int(name, getattr(self, name))
        if self.num_device_pages is not None:
            _positive_int("num_device_pages", self.num_device_pages)
            if self.num_device_pages < 2:
                raise ValueError("num_device_pages must be >= 2 (page 0 is the null page)")
        f = self.device_memory_fraction
        if isinstance(f, bool) or not isinstance(f, int | float) or not (0 < f <= 1) \
                or not math.isfinite(f):
            raise ValueError(f"device_memory_fraction must be in (0, 1], got {f!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        if self.max_prefill_chunk > self.max_num_batched_tokens:
            raise ValueError(
                f"max_prefill_chunk ({self.max_prefill_chunk}) must not exceed "
                f"max_num_batched_tokens ({self.max_num_batched_tokens})"
            )
        if not isinstance(self.default_slo, SLO):
            raise ValueError(f"default_slo must be an SLO, got {self.default_slo!r}")

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)

    @property
    def decode_buckets(self) -> tuple[int, ...]:
        """Batch sizes a decode step is padded to."""
        return _pow2_buckets(1, self.max_num_seqs)

    @property
    def prefill_chunk_buckets(self) -> tuple[int, ...]:
        """Chunk lengths (columns) a prefill step is padded to: powers of 4 from 16."""
        out, c = [], min(16, self.max_prefill_chunk)
        while c < self.max_prefill_chunk:
            out.append(c)
            c *= 4
        out.append(self.max_prefill_chunk)
        return tuple(out)

    @property
    def prefill_row_buckets(self) -> tuple[int, ...]:
        """Row counts a prefill step is padded to: one long prompt, or a packed few.

        Kept to two because every bucket is a full-model compile at warm-up."""
        return tuple(sorted({1, self.max_prefill_rows}))
