"""Engine configuration: frozen dataclasses validated on construction.

Every field is declared with its bounds and help (``knob``) and checked by the one
validator (``superinfer_jax.config_schema``); every error is a ``ConfigError`` naming the
field, so a bad YAML key or CLI flag is found without a debugger.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from superinfer_jax.config_schema import (
    ConfigError,
    internal,
    knob,
    power_of_two,
    type_hints,
    validate,
)
from superinfer_jax.kv.host_cache import HOST_CACHE_EVICTIONS
from superinfer_jax.kv.quant import KV_DTYPES
from superinfer_jax.request import MAX_DEFERRED_ROWS, SLO
from superinfer_jax.sched.rotasched_config import (  # noqa: F401 - re-exported: the engine's config
    DUE_ORDERS,
    LATE_ORDERS,
    PARKED_REPLIES,
    RANKING_MODES,
    RotaSchedConfig,
)

DTYPES = ("float32", "bfloat16")
ATTENTION_BACKENDS = ("auto", "xla", "pallas")
COPY_MODES = ("device_put", "fused", "in_step")  # DuplexKV's (duplexkv/mover.py)


def bucket(value: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket holding ``value`` (the engine pads a call to it)."""
    for b in buckets:
        if value <= b:
            return b
    raise ValueError(f"{value} exceeds the largest bucket {buckets[-1]}")


@dataclass(frozen=True)
class BucketLimits:
    """The largest call shapes that are compiled, each a bucket whose smaller buckets are
    compiled too (prefill chunks: down to ``min_prefill_chunk``), so a step the scheduler
    keeps within them pads only to compiled shapes (``superinfer_jax.runner.step_programs``).
    Zero: nothing of that kind may run yet."""

    decode_rows: int  # rows of a decode call
    prefill_rows: int  # rows of a prefill call (1 or max_prefill_rows)
    prefill_chunk: int  # columns of a prefill call: the longest chunk of one row
    deferred_rows: int  # structured-output rows sampled after the step (resample)
    # DuplexKV's page copies compiled and run once: until then no eager shadow (nor spill)
    # is planned, so the first steps after a cold ready never compile the gather inline
    copies: bool = True
    # The shortest compiled prefill chunk when the ready set's chunk is not the smallest
    # bucket and the ones below it are still compiling: a shorter chunk is padded to it.
    # 0: every chunk bucket up to ``prefill_chunk`` is compiled (no padding floor).
    min_prefill_chunk: int = 0

    def prefill_columns(self, chunk_bucket: int) -> int:
        """The compiled column count a prefill call whose longest chunk pads to
        ``chunk_bucket`` runs at."""
        return max(chunk_bucket, self.min_prefill_chunk)


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
    scatter by converting the whole pool, every layer of every step, so a CPU engine keeps
    its KV cache in float32 (docs/results/rotasched.md)."""
    import jax

    if model_dtype == "bfloat16" and jax.default_backend() == "cpu":
        return "float32"
    return model_dtype


POLICIES = ("fcfs", "swap", "rotasched")
@dataclass(frozen=True)
class ModelLayout:
    """The ``model:`` keys the engine reads (the weights' source and dtype are the
    server's, ``serving.config_schema.ModelSection``)."""

    max_model_len: int = knob(2048, ge=2, help="prompt + output tokens per request")
    kv_cache_dtype: str = knob(
        "float32", choices=KV_DTYPES,
        help="KV cache dtype: float32 | bfloat16 | fp8_e4m3 (per-layer, per-head scales "
             "calibrated at start) | fp8_e5m2 (no scales); docs/quantization.md")
    tensor_parallel_size: int = knob(
        1, ge=1,
        help="devices to split the model over: this host's, or with --num-processes the "
             "whole group's (docs/tensor_parallel.md)")

    def __post_init__(self) -> None:
        validate(self, prefix="model.")


@dataclass(frozen=True)
class HardwareConfig:
    """Device pages and kernels.

    Device pages: ``num_device_pages`` if set, else ``kv_cache_memory_gb`` worth of pages
    of the KV dtype (its scales counted), else ``device_memory_fraction`` of the
    accelerator's free memory (where the backend reports it), else enough pages for
    ``max_num_seqs`` requests of ``max_model_len`` tokens. With tensor parallelism a page
    id still names one page, each device holding its KV heads of it: page counts and
    ``kv_cache_memory_gb`` are totals over the mesh, ``device_memory_fraction`` applies to
    each device."""

    page_size: int = knob(16, ge=1, check=power_of_two,
                          help="tokens per KV page (a power of two)")
    num_device_pages: int | None = knob(
        None, ge=2, example=4096,
        help="fixed device page count (page 0 is the null page) instead of "
             "device_memory_fraction (CPU default: enough for max_num_seqs)")
    kv_cache_memory_gb: float | None = knob(
        None, gt=0, example=8.0,
        help="GiB of device KV pool (all devices together), scales included: the page "
             "count follows model.kv_cache_dtype; overrides device_memory_fraction")
    device_memory_fraction: float = knob(
        0.9, gt=0, le=1, help="of free accelerator memory given to KV pages")
    attention_backend: str = knob("auto", choices=ATTENTION_BACKENDS,
                                  help="auto | xla | pallas")
    compilation_cache_dir: str | None = knob(
        None, help="persistent XLA cache: later starts skip the compiler")

    def __post_init__(self) -> None:
        validate(self, prefix="hardware.")


@dataclass(frozen=True)
class BatchingConfig:
    """The ``engine:`` keys: batching, compilation and the scheduling policy."""

    max_num_seqs: int = knob(32, ge=1, help="most requests in one step")
    max_num_batched_tokens: int = knob(
        512, ge=1, help="token budget of one step (decode + prefill chunks)")
    max_prefill_chunk: int = knob(
        256, ge=1, help="longest prefill chunk of one request in one step")
    max_prefill_rows: int = knob(4, ge=1, help="most requests prefilling in one step")
    seed: int = knob(0, ge=0, help="seeds the sampler of a request that sends no seed")
    warmup: bool = knob(True, help="compile every step bucket before serving")
    compile_in_background: bool = knob(
        False,
        help="ready once the smallest step buckets are compiled; the rest compile in the "
             "background while calls are capped to compiled buckets (with warmup)")
    ready_prefill_chunk: int = knob(
        32, ge=1,
        help="with compile_in_background: the prefill chunk compiled before ready (rounded "
             "up to a chunk bucket, at most max_prefill_chunk); until the shorter chunk "
             "buckets compile, shorter chunks are padded to it")
    async_scheduling: bool = knob(
        True, help="plan and dispatch step t+1 while step t runs (tokens fed back on device)")
    structured_outputs_disable_any_whitespace: bool = knob(
        False,
        help="JSON structured outputs without free whitespace between tokens (vLLM's "
             "disable_any_whitespace): shorter outputs, and a weak model cannot spend its "
             "max_tokens on blank lines")
    # A registered name (``POLICIES`` are built in) or a ``module:Class`` path, resolved
    # where the scheduler is built (``sched.rotasched.registry.make_scheduler``).
    policy: str = knob("fcfs", help="fcfs (vLLM V1: recompute) | swap (vLLM V0) | rotasched")

    def __post_init__(self) -> None:
        validate(self, prefix="engine.")
        if self.max_prefill_chunk > self.max_num_batched_tokens:
            raise ConfigError(
                "engine.max_prefill_chunk", f"must not exceed max_num_batched_tokens "
                f"({self.max_num_batched_tokens}), got {self.max_prefill_chunk}")


@dataclass(frozen=True)
class DuplexKVConfig:
    """The host tier (pinned host memory) for rotated KV pages: ``num_host_pages`` if
    set, else ``host_memory_gb`` worth of pages (totals over a tensor-parallel mesh). 0
    (the default) disables it: a request that would rotate is recomputed instead."""

    num_host_pages: int | None = knob(
        None, ge=0, example=16384,
        help="host tier capacity in pages; overrides host_memory_gb")
    host_memory_gb: float = knob(
        0.0, ge=0, help="GiB of pinned host memory for rotated KV pages (0: no host tier)")
    transfer_budget_pages: int = knob(
        2400, ge=1, help="pages moved between tiers per step, each direction (paper: 2400)")
    eager_shadowing: bool = knob(
        True, help="copy full pages to host as they fill, so an eviction moves one page")
    copy_mode: str | None = knob(
        None, choices=COPY_MODES, example="in_step",
        help="how pages are copied: device_put | fused | in_step (inside the model step); "
             "default: fused on CPU, device_put on GPU/TPU (duplexkv/mover.py)")
    in_step_pages: int = knob(
        32, ge=1,
        help="in_step mode: pages each way a decode step copies inside its own program "
             "(one compiled count; the rest goes by the separate copy programs)")

    def __post_init__(self) -> None:
        validate(self, prefix="duplex_kv.")


@dataclass(frozen=True)
class PrefixCachingConfig:
    """Automatic prefix caching: full KV pages shared by hash, on the device and (with a
    host tier) in host memory."""

    enabled: bool = knob(
        True,
        help="share full KV pages between requests with the same prefix (and cache_salt); "
             "with a host tier, pages evicted from the device stay findable on the host")
    cache_generated: bool = knob(
        True,
        help="also cache full pages of generated tokens (vLLM and SGLang do: a chat client "
             "resends the reply in the next turn); false caches prompt pages only "
             "(LMCache's save_decode_cache default), for traffic that never resends replies")
    keep_queued: bool = knob(
        True,
        help="a cached device page that a waiting request will reuse is reclaimed only "
             "after every other cached page (the queue is known demand); false: plain "
             "LRU, as vLLM")
    host_eviction: str = knob(
        "lru", choices=HOST_CACHE_EVICTIONS,
        help="which cache-only host page goes first: lru (least recently used) | fifo "
             "(oldest stored; a hit does not renew it)")
    host_max_pages: int | None = knob(
        None, ge=0, example=8192,
        help="most host pages holding cache-only copies (default: any host page no "
             "request needs); 0 keeps the host tier for rotation only")

    def __post_init__(self) -> None:
        validate(self, prefix="prefix_caching.")


SPECULATIVE_METHODS = ("none", "ngram", "draft")
SPECULATIVE_MODES = ("fixed", "slo")
DRAFT_QUANTIZATIONS = ("none", "int8", "fp8", "w8a8_int8")  # models.quant.MODES, not imported
MAX_SPECULATIVE_TOKENS = 16  # a verify call's columns: 1 + num_tokens


def _proposer_name(key: str, name: str) -> str | None:
    """A built-in method or a plug-in's ``package.module:Class`` (loaded at engine start)."""
    if name in SPECULATIVE_METHODS or ":" in name:
        return None
    return f"must be one of {list(SPECULATIVE_METHODS)} or package.module:Class, got {name!r}"


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (docs/speculative.md): a proposer guesses up to
    ``num_tokens`` tokens per decoding request, one forward pass verifies them, and
    acceptance keeps the output exactly the target model's."""

    method: str = knob(
        "none", check=_proposer_name,
        help="none | ngram (prompt lookup: continue a repeated n-gram of the request) | "
             "draft (a smaller model, draft_model) | a proposer's package.module:Class")
    num_tokens: int = knob(
        3, ge=1, le=MAX_SPECULATIVE_TOKENS,
        help="most proposed tokens per request and step (k; a verify row is 1 + k tokens)")
    draft_model: str | None = knob(
        None, example="smollm2-135m",
        help="method draft: the draft model (same tokenizer and vocabulary as the target)")
    draft_quantization: str = knob(
        "none", choices=DRAFT_QUANTIZATIONS,
        help="method draft: the draft's weights quantized at load (int8 with draft_model "
             "the target's own: the quantized self-draft)")
    draft_layers: int | None = knob(
        None, ge=1, example=12,
        help="method draft: keep only the draft's first N decoder layers (then its final "
             "norm and head): a cheaper, less accurate self-draft; null: every layer")
    draft_vocab: int | None = knob(
        None, ge=1, example=16384,
        help="method draft: the draft's head scores only the N most frequent tokens "
             "(FR-Spec; models/data's ranking for its tokenizer): cheaper draft steps, "
             "a guess outside them is never made; null: the whole vocabulary")
    mode: str = knob(
        "fixed", choices=SPECULATIVE_MODES,
        help="fixed: every eligible request proposes num_tokens | slo: the speculation "
             "length per request from its TBT slack and acceptance rate (0 allowed)")

    def __post_init__(self) -> None:
        validate(self, prefix="speculative.")

    @property
    def enabled(self) -> bool:
        return self.method != "none"


def _section(cls: type) -> Any:
    return dataclasses.field(default_factory=cls)


@dataclass(frozen=True)
class EngineConfig:
    """How the engine lays out memory and batches work: one frozen section per section of
    the deployment file (``serving.config_schema``), each field a ``knob`` with its one
    default, bounds and help, checked by the one validator (``superinfer_jax.config_schema``).

    Read a knob by its section (``config.hardware.page_size``); build or change one by its
    flat name (``EngineConfig.build(page_size=8, policy="swap")``, ``config.replace(...)``,
    names in ``FLAT_KNOBS``), as vLLM's ``EngineArgs`` builds its config."""

    model: ModelLayout = _section(ModelLayout)
    hardware: HardwareConfig = _section(HardwareConfig)
    engine: BatchingConfig = _section(BatchingConfig)
    default_slo: SLO = _section(SLO)
    rotasched: RotaSchedConfig = _section(RotaSchedConfig)
    duplex_kv: DuplexKVConfig = _section(DuplexKVConfig)
    prefix_caching: PrefixCachingConfig = _section(PrefixCachingConfig)
    speculative: SpeculativeConfig = _section(SpeculativeConfig)
    show_progress: bool = internal(
        True, reason="a terminal's progress bar, set by the command (batch --no-progress)")

    def __post_init__(self) -> None:
        validate(self)

    @classmethod
    def build(cls, **knobs: Any) -> EngineConfig:
        """A config from flat knob names (``page_size=8``) and whole sections
        (``rotasched=RotaSchedConfig(...)``), every other knob at its default."""
        return _DEFAULT.replace(**knobs)

    @classmethod
    def knob_names(cls) -> frozenset[str]:
        """The keywords ``build`` and ``replace`` take: flat knob names and sections."""
        return frozenset(FLAT_KNOBS) | _TOP_FIELDS

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with knobs changed by flat name (``FLAT_KNOBS``) or whole section."""
        sections: dict[str, Any] = {}
        by_section: dict[str, dict[str, Any]] = {}
        for key, value in changes.items():
            where = FLAT_KNOBS.get(key)
            if where is not None:
                by_section.setdefault(where[0], {})[where[1]] = value
            elif key in _TOP_FIELDS:
                sections[key] = value
            else:
                raise TypeError(f"EngineConfig has no knob {key!r}")
        for section, values in by_section.items():
            base = sections.get(section, getattr(self, section))
            try:
                sections[section] = dataclasses.replace(base, **values)
            except ConfigError as e:  # named as the caller spelled it: the flat name
                raise e.with_key(_FLAT_OF.get(e.key, e.key)) from e
        return dataclasses.replace(self, **sections)

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.model.max_model_len // self.hardware.page_size)

    # The buckets and limits below are ``cached_property``: a frozen config never changes
    # them, and the scheduler and the simulator read them every step. The cache lives in
    # the instance's ``__dict__``, outside the fields: equality, hashing, ``repr`` and
    # ``dataclasses.replace`` (a fresh instance) never see it.

    @cached_property
    def deferred_rows(self) -> int:
        """Structured-output rows a step may sample later (``MAX_DEFERRED_ROWS``, at most
        one per sequence)."""
        return min(MAX_DEFERRED_ROWS, self.engine.max_num_seqs)

    @cached_property
    def decode_buckets(self) -> tuple[int, ...]:
        """Batch sizes a decode step is padded to."""
        return _pow2_buckets(1, self.engine.max_num_seqs)

    @cached_property
    def prefill_chunk_buckets(self) -> tuple[int, ...]:
        """Chunk lengths (columns) a prefill step is padded to: powers of 2 from 16, so
        padding wastes at most half the call (docs/results/rotasched.md)."""
        chunk = self.engine.max_prefill_chunk
        return _pow2_buckets(min(16, chunk), chunk)

    @cached_property
    def ready_chunk_bucket(self) -> int:
        """The prefill chunk bucket of the ready set (``ready_prefill_chunk``, rounded up
        to a bucket, at most ``max_prefill_chunk``; ``compilation.ready_set``)."""
        return bucket(min(self.engine.ready_prefill_chunk, self.engine.max_prefill_chunk),
                      self.prefill_chunk_buckets)

    @cached_property
    def prefill_shapes(self) -> tuple[tuple[int, int], ...]:
        """(rows, columns) buckets a prefill call can take, all compiled at warm-up: one
        row at any column bucket, more rows only where the padded shape fits the token
        budget (the scheduler packs rows no further; ``Scheduler._prefill_chunk_cap``)."""
        return tuple((r, c) for c in self.prefill_chunk_buckets for r in self.prefill_row_buckets
                     if r == 1 or r * c <= self.engine.max_num_batched_tokens)

    @cached_property
    def bucket_limits(self) -> BucketLimits:
        """Every bucket compiled: the limits of a warmed-up engine and of the simulator."""
        e = self.engine
        return BucketLimits(e.max_num_seqs, e.max_prefill_rows, e.max_prefill_chunk,
                            self.deferred_rows)

    @cached_property
    def prefill_row_buckets(self) -> tuple[int, ...]:
        """Row counts a prefill step is padded to: one long prompt, or a packed few.

        Kept to two because every bucket is a full-model compile at warm-up."""
        return tuple(sorted({1, self.engine.max_prefill_rows}))


# Each knob's flat name (the builder's and ``replace``'s keyword) -> (section, name): its
# own name, but for the few whose name in their section reads differently.
_FLAT_NAMES = {"kv_cache_dtype": "dtype", "enabled": "enable_prefix_caching",
               "cache_generated": "prefix_cache_generated",
               "keep_queued": "prefix_cache_keep_queued",
               "host_eviction": "host_cache_eviction", "host_max_pages": "host_cache_max_pages",
               "structured_outputs_disable_any_whitespace": "disable_any_whitespace",
               "method": "speculative_method", "num_tokens": "num_speculative_tokens",
               "draft_model": "speculative_draft_model", "mode": "speculative_mode",
               "draft_quantization": "speculative_draft_quantization",
               "draft_layers": "speculative_draft_layers",
               "draft_vocab": "speculative_draft_vocab"}
_FLAT_SECTIONS = ("model", "hardware", "engine", "duplex_kv", "prefix_caching",
                  "speculative")
FLAT_KNOBS: dict[str, tuple[str, str]] = {
    _FLAT_NAMES.get(f.name, f.name): (section, f.name)
    for section in _FLAT_SECTIONS
    for f in dataclasses.fields(type_hints(EngineConfig)[section])
}
_FLAT_OF = {f"{section}.{name}": flat for flat, (section, name) in FLAT_KNOBS.items()}
_TOP_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))
_DEFAULT = EngineConfig()
