"""Engine configuration: frozen dataclasses validated on construction.

Every error names the field, so a bad YAML key or CLI flag is found without a debugger.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from superinfer_jax.request import PRIORITY_CLASSES, SLO

DTYPES = ("float32", "bfloat16")
ATTENTION_BACKENDS = ("auto", "xla", "pallas")


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def bucket(value: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket holding ``value`` (the engine pads a call to it)."""
    for b in buckets:
        if value <= b:
            return b
    raise ValueError(f"{value} exceeds the largest bucket {buckets[-1]}")


def _pow2_buckets(low: int, high: int) -> tuple[int, ...]:
    out, b = [], low
    while b < high:
        out.append(b)
        b *= 2
    out.append(high)
    return tuple(out)


def default_kv_dtype(model_dtype: str) -> str:
    """The KV cache dtype to pair with a model dtype on this backend.

    The model's own dtype, except bfloat16 on CPU: XLA:CPU performs an in-place bfloat16
    scatter by converting the whole pool, every layer of every step (2 s a step for
    SmolLM2 with a 200 MB pool), so a CPU engine keeps its KV cache in float32."""
    import jax

    if model_dtype == "bfloat16" and jax.default_backend() == "cpu":
        return "float32"
    return model_dtype


POLICIES = ("fcfs", "swap", "rotasched")
RANKING_MODES = ("vlt", "slack")


def _default_priority_weights() -> dict[str, float]:
    return {"critical": 4.0, "standard": 1.0, "batch": 0.25}


@dataclass(frozen=True)
class RotaSchedConfig:
    """The paper's policy parameters (defaults: alpha 3, beta_F 0.5, beta_B 0).

    ``high_water_mark``: share of device pages in use at which the policy starts acting
    (proactively, before an allocation fails). ``min_residency_tokens``: tokens a request
    produces after it is admitted or rotated in before it may be rotated out again, so
    every rotation buys progress and overload does not turn into a rotation storm; a
    request within that many tokens of its ``max_tokens`` is not rotated out either.
    ``mode``: rank by virtual lag (``vlt``) or by predicted slack from the latency model
    (``slack``). ``priority_weights`` scale a
    request's lag by its SLO's priority class.
    """

    alpha: float = 3.0
    beta_f: float = 0.5
    beta_b: float = 0.0
    high_water_mark: float = 0.85
    mode: str = "vlt"
    # A request runs this many tokens before it can rotate out. 16 (not 4): in simulation
    # of the policy sweep at overload, 4 rotated 3-4x as often and lost 5-15 points of
    # TBT attainment, for TTFT attainment within about 8 points either way.
    min_residency_tokens: int = 16
    priority_weights: dict[str, float] = dataclasses.field(
        default_factory=_default_priority_weights)
    latency_profile: str | None = None  # JSON written by LatencyModel.save

    def __post_init__(self) -> None:
        for name in ("alpha", "beta_f", "beta_b"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0 \
                    or not math.isfinite(value):
                raise ValueError(f"rotasched.{name} must be a finite number >= 0, got {value!r}")
        h = self.high_water_mark
        if isinstance(h, bool) or not isinstance(h, int | float) or not 0 < h <= 1:
            raise ValueError(f"rotasched.high_water_mark must be in (0, 1], got {h!r}")
        m = self.min_residency_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"rotasched.min_residency_tokens must be an int >= 1, got {m!r}")
        if self.mode not in RANKING_MODES:
            raise ValueError(f"rotasched.mode must be one of {RANKING_MODES}, got {self.mode!r}")
        unknown = set(self.priority_weights) - set(PRIORITY_CLASSES)
        if unknown:
            raise ValueError(f"rotasched.priority_weights has unknown classes {sorted(unknown)}")
        for cls in PRIORITY_CLASSES:
            w = self.priority_weights.get(cls)
            if isinstance(w, bool) or not isinstance(w, int | float) or not w > 0:
                raise ValueError(f"rotasched.priority_weights.{cls} must be > 0, got {w!r}")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine lays out memory and batches work.

    Device pages: ``num_device_pages`` if set, else ``device_memory_fraction`` of the
    accelerator's free memory (where the backend reports it), else enough pages for
    ``max_num_seqs`` requests of ``max_model_len`` tokens.

    Host pages (the DuplexKV tier, pinned host memory): ``num_host_pages`` if set, else
    ``host_memory_gb`` worth of pages. 0 (the default) disables the host tier: the engine
    then behaves exactly as before, and a request that would rotate is recomputed.

    ``tensor_parallel_size``: devices the model and both KV tiers are split over (KV
    heads per device). A page id still names one page; each device holds its heads of it,
    so page counts and ``host_memory_gb`` are totals over the mesh, while
    ``device_memory_fraction`` applies to each device.
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
    num_host_pages: int | None = None  # host tier capacity in pages; overrides host_memory_gb
    host_memory_gb: float = 0.0  # host tier capacity in GiB of pinned host memory
    transfer_budget_pages: int = 2400  # pages moved per step, each direction (paper: 2400)
    eager_shadowing: bool = True  # copy pages to host as they fill, so eviction moves one
    # Plan and dispatch step t+1 while step t runs; tokens feed back on the device.
    async_scheduling: bool = True
    policy: str = "fcfs"  # fcfs (vLLM V1 recompute), swap (vLLM V0), rotasched
    rotasched: RotaSchedConfig = dataclasses.field(default_factory=RotaSchedConfig)
    tensor_parallel_size: int = 1  # devices of the 1-D "tp" mesh (superinfer_jax.parallel)

    def __post_init__(self) -> None:
        for name in ("page_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                     "max_prefill_chunk", "max_prefill_rows", "tensor_parallel_size"):
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
        self._validate_host_tier()
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if not isinstance(self.rotasched, RotaSchedConfig):
            raise ValueError(f"rotasched must be a RotaSchedConfig, got {self.rotasched!r}")
        if not isinstance(self.default_slo, SLO):
            raise ValueError(f"default_slo must be an SLO, got {self.default_slo!r}")

    def _validate_host_tier(self) -> None:
        if self.num_host_pages is not None and (
                isinstance(self.num_host_pages, bool) or not isinstance(self.num_host_pages, int)
                or self.num_host_pages < 0):
            raise ValueError(
                f"num_host_pages must be a non-negative int or None, got {self.num_host_pages!r}")
        g = self.host_memory_gb
        if isinstance(g, bool) or not isinstance(g, int | float) or not math.isfinite(g) \
                or g < 0:
            raise ValueError(f"host_memory_gb must be a finite number >= 0, got {g!r}")
        _positive_int("transfer_budget_pages", self.transfer_budget_pages)
        for name in ("eager_shadowing", "async_scheduling"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

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
        """Chunk lengths (columns) a prefill step is padded to: powers of 2 from 16.

        Padding wastes at most half the call. With powers of 4, a 105-token prompt (the
        median of the policy sweep) ran as 256 columns; in the calibrated simulator
        powers of 2 gave every policy 4-5% more throughput for a few more compiles."""
        return _pow2_buckets(min(16, self.max_prefill_chunk), self.max_prefill_chunk)

    @property
    def prefill_shapes(self) -> tuple[tuple[int, int], ...]:
        """(rows, columns) buckets a prefill call can take, all compiled at warm-up: one
        row at any column bucket, more rows only where the padded shape fits the token
        budget (the scheduler packs rows no further; ``FCFSScheduler._prefill_chunk_cap``)."""
        return tuple((r, c) for c in self.prefill_chunk_buckets for r in self.prefill_row_buckets
                     if r == 1 or r * c <= self.max_num_batched_tokens)

    @property
    def prefill_row_buckets(self) -> tuple[int, ...]:
        """Row counts a prefill step is padded to: one long prompt, or a packed few.

        Kept to two because every bucket is a full-model compile at warm-up."""
        return tuple(sorted({1, self.max_prefill_rows}))
