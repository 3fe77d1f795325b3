"""The model runner: everything that lives on the device, behind one object.

It owns the device state and the calls on it, as vLLM V1's model runner does: the model
placed on its mesh (one device, or tensor-parallel), the paged KV pool, the DuplexKV
rotation engine that copies the pool's pages to and from the host tier, the jitted step
with the pool donated, the shape buckets and their warm-up, building a step's padded
inputs from scheduled rows, and the token feedback of asynchronous scheduling (the step
in flight). Nothing in here decides who runs or what a token means: the scheduler plans,
the output processor interprets, ``LLMEngine`` narrates.

Blast radius: building one row's inputs can fail for that request alone (an out-of-range
value that slipped past validation, a missing page table); ``dispatch`` reports it and
pads the row instead of raising, so the rest of the batch runs.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import jax
import numpy as np
from jax.sharding import Mesh
from tqdm.auto import tqdm

import superinfer_jax.ops as ops
from superinfer_jax.config import BucketLimits, EngineConfig, bucket
from superinfer_jax.dist import parallel
from superinfer_jax.duplexkv import DuplexKV, RotationEvent
from superinfer_jax.duplexkv.mover import gather_in_step, land_in_step
from superinfer_jax.duplexkv.rotation import StepCopies
from superinfer_jax.kv.host_pool import HostPool, num_host_pages_for
from superinfer_jax.kv.layout import NULL_PAGE, PoolLayout
from superinfer_jax.kv.two_tier import PageMoves, TwoTierKVManager
from superinfer_jax.model_api import ServableModel, StepInputs
from superinfer_jax.ops import native
from superinfer_jax.request import Request
from superinfer_jax.runner import executable_cache
from superinfer_jax.runner.executable_cache import ExecutableCache
from superinfer_jax.runner.logits import (
    LogitsInputs,
    StepLogprobs,
    deferred_logits,
    neutral_logits_inputs,
    no_prompt_logprobs,
    process_logits,
    prompt_logprobs,
    sampled_logprobs,
)
from superinfer_jax.runner.sampling import SamplingInputs, sample
from superinfer_jax.runner.step_programs import (
    DUPLEX,
    REFILL,
    RESAMPLE,
    STEP,
    BucketCompiler,
    Program,
    Programs,
    bucket_limits,
    compile_order,
    default_num_threads,
    ready_set,
)
from superinfer_jax.runner.token_feedback import (
    NO_SOURCE,
    TokenFeedback,
    apply_feedback,
    pad_sampled,
)

_CPU_DEFAULT_POOL_BYTES = 2 << 30
IN_STEP = "in_step"  # a Program kind: the decode step with DuplexKV's copies inside
log = logging.getLogger(__name__)


@dataclass
class CallRow:
    """One row of a dispatched call: its request, the first position it computes, its
    token count, and whether it samples the request's next token (its last row)."""

    req: Request
    start: int
    num_tokens: int
    final: bool


@dataclass
class InflightStep:
    """A dispatched step whose tokens the host has not read: per call (prefill, decode)
    its sampled arrays, its logprobs when a row asked (read only then), and its rows."""

    prefill: jax.Array | None = None
    decode: jax.Array | None = None
    prefill_logprobs: StepLogprobs | None = None
    decode_logprobs: StepLogprobs | None = None
    prefill_rows: list[CallRow] = dataclasses.field(default_factory=list)
    decode_rows: list[CallRow] = dataclasses.field(default_factory=list)
    sources: dict[str, int] = dataclasses.field(default_factory=dict)  # req_id -> feedback
    # Deferred sampling (structured outputs under async scheduling): the decode call's
    # raw logits of those rows, then (``ModelRunner.resample``) their tokens.
    deferred_logits: jax.Array | None = None
    deferred_index: dict[str, int] = dataclasses.field(default_factory=dict)  # -> slot
    deferred: jax.Array | None = None
    deferred_logprobs: StepLogprobs | None = None


@dataclass
class Dispatched:
    """One dispatched call: its sampled tokens (None when no row was left), its logprobs
    (None when no row asked), the rows that run, in order, and the requests whose rows
    could not be built, with why."""

    sampled: jax.Array | None
    logprobs: StepLogprobs | None
    rows: list[tuple[Request, int]]
    failed: list[tuple[Request, BaseException]]
    deferred: list[int] = dataclasses.field(default_factory=list)  # rows sampled later
    deferred_logits: jax.Array | None = None


class ModelRunner:
    """Device state and the calls on it, for one engine."""

    def __init__(self, model: ServableModel, config: EngineConfig):
        self.config = config
        if config.compilation_cache_dir:
            enable_compilation_cache(config.compilation_cache_dir)
        self.mesh = self._make_mesh()  # None: one device, exactly as without TP
        self.model = model = self._place_model(model)
        self.layout = PoolLayout(model.kv_spec, config.page_size, config.dtype)
        self.num_device_pages = self._choose_num_pages()
        self.num_host_pages = num_host_pages_for(config, self.layout.page_bytes)
        # The pages' bookkeeping (host only): the scheduler plans with it, DuplexKV copies
        # the pages it names.
        self.kv = TwoTierKVManager.for_config(config, self.num_device_pages,
                                              self.num_host_pages)
        self.duplex: DuplexKV | None = None  # the rotation engine, when a host tier exists
        if self.num_host_pages > 0:
            self.duplex = self._new_duplex()
        self._pool_spec = jax.ShapeDtypeStruct(
            self.layout.pool_shape(self.num_device_pages), jax.numpy.dtype(self.layout.dtype),
            sharding=self._pool_sharding())
        self._kv_pool: jax.Array | None = None
        self._pool_error: BaseException | None = None
        # Not a daemon: the interpreter joins it at exit. A daemon thread still inside
        # XLA's fill when a short script ended (an engine never read, warmup=False) was
        # torn down mid-call and aborted the process ("FATAL: exception not rethrown").
        self._pool_thread = threading.Thread(target=self._allocate_pool, name="kv-pool",
                                             daemon=False)
        if jax.process_count() == 1:
            self._pool_thread.start()
        else:  # several processes issue their device programs in one order: inline
            self._allocate_pool()
        self.backend = ops.resolve_backend(config.attention_backend)
        self.feedback_width = max(config.decode_buckets + config.prefill_row_buckets)
        self.no_tokens = self._committed(np.zeros(self.feedback_width, np.int32))
        self.inflight: InflightStep | None = None  # dispatched, tokens not read yet
        self.last_logprobs: StepLogprobs | None = None  # of the last call_step
        self.last_deferred_logits: jax.Array | None = None
        # The step takes the weights as a flat list: jit flattens its arguments on every
        # call, and flattening the nnx.State (273 leaves for SmolLM2) costs 0.26 ms more
        # per call than a list (0.32 against 0.06 ms on this CPU), twice a step.
        self.step_params, self._params_treedef = jax.tree.flatten(self.model.params)
        self._eos_token_ids = tuple(int(t) for t in model.eos_token_ids)
        self._neutral: dict[tuple[int, int], LogitsInputs] = {}  # (rows, cols) -> committed
        # Called like the jitted functions; each shape compiled ahead of time (warm-up).
        cache = self._executable_cache()
        self.step_programs = Programs(self._jit_step(), key=lambda a: a[2].tokens.shape,
                                      cache=cache, name=STEP)
        # in_step copy mode: the step with page copies inside, per (step shape, pages
        # out, pages in); see ``in_step_shapes``
        self.in_step_programs = Programs(
            self._jit_step_in_step(),
            key=lambda a: (*a[2].tokens.shape, a[6].shape[0], a[7].shape[0]))
        self._rotation_events: list[RotationEvent] = []  # from copies issued in calls
        self.resample_programs = Programs(jax.jit(self._resample, static_argnums=(0,)),
                                          key=lambda a: (a[0],), num_static=1,
                                          cache=cache, name=RESAMPLE)
        self._step_fn: Callable[..., Any] = self.step_programs
        self._resample_fn: Callable[..., Any] = self.resample_programs
        self.resample_buckets = tuple(b for b in config.decode_buckets
                                      if b < config.deferred_rows) + (config.deferred_rows,)
        # What the scheduler may plan: every bucket, unless warm-up compiles in the
        # background (then what is compiled so far, growing; ``runner.step_programs``).
        self.limits: BucketLimits = config.bucket_limits
        self.compiler: BucketCompiler | None = None
        # background step programs run once on a scratch pool before they are published
        # (``_first_run_on_scratch``)
        self._scratch_runs = False
        self._scratch_left = 0  # step programs still to run on the scratch pool
        self._scratch_pool: jax.Array | None = None
        self._scratch_lock = threading.Lock()
        self.duplex_warm = True  # DuplexKV's copy programs compiled (or none to compile)
        self._limits_lock = threading.Lock()

    # -- setup -------------------------------------------------------------------------

    def _make_mesh(self) -> Mesh | None:
        tp = self.config.tensor_parallel_size
        return parallel.make_mesh(tp) if tp > 1 else None

    def _place_model(self, model: ServableModel) -> ServableModel:
        """The model on this engine's mesh: as given when it already is (loaded with
        ``tensor_parallel_size``), else sharded now through its ``shard(mesh)``."""
        model_mesh: Mesh | None = getattr(model, "mesh", None)
        if model_mesh == self.mesh:
            if self.mesh is not None:
                parallel.check_kv_heads(model.kv_spec.num_kv_heads, self.mesh)
            return model
        if self.mesh is None:
            assert model_mesh is not None  # else the meshes would be equal (both None)
            raise ValueError(f"tensor_parallel_size is 1 but the model is sharded over "
                             f"{model_mesh.size} devices; set tensor_parallel_size to match")
        shard = getattr(model, "shard", None)
        if shard is None:
            raise ValueError(f"tensor_parallel_size={self.mesh.size}: this model cannot be "
                             "sharded (it has no shard(mesh))")
        model = shard(self.mesh)
        parallel.check_kv_heads(model.kv_spec.num_kv_heads, self.mesh)
        return model

    @property
    def kv_pool(self) -> jax.Array:
        """The device KV pool; the first read waits for ``_allocate_pool``."""
        if self._kv_pool is None:
            if self._pool_thread.ident is not None:
                self._pool_thread.join()
            if self._pool_error is not None:
                raise RuntimeError(f"allocating the KV pool failed: {self._pool_error}"
                                   ) from self._pool_error
            assert self._kv_pool is not None
        return self._kv_pool

    @kv_pool.setter
    def kv_pool(self, pool: jax.Array) -> None:
        self._kv_pool = pool

    def _allocate_pool(self) -> None:
        """Build the zeroed pool on its own thread: zeroing it where XLA must fill it (a
        sharded pool; 2 GiB by default) is seconds of CPU (XLA:CPU runs the fill inline),
        which then overlaps the loading or compiling of the ready set; the first read of
        ``kv_pool`` (the warm-up's first run) waits for it. The pool's placement was
        promised to the compiles (``_pool_spec``): a pool placed otherwise is an error
        here, not a recompile in the serving path."""
        try:
            pool = self._new_pool()
            if self.duplex is not None:
                pool = self.duplex.adopt(pool)
            if pool.sharding != self._pool_spec.sharding:
                raise RuntimeError(f"the pool is placed {pool.sharding}, its programs are "
                                   f"compiled for {self._pool_spec.sharding}")
            self._kv_pool = pool
        except BaseException as e:  # raised by the first read of kv_pool
            self._pool_error = e

    def _pool_sharding(self) -> jax.sharding.Sharding:
        """Where ``_allocate_pool`` places the pool (known before it has run)."""
        if self.duplex is not None:
            return self.duplex.pool_sharding or self.duplex.host.device_sharding
        if self.mesh is None:
            return jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return parallel.pool_sharding(self.mesh)

    def _new_pool(self) -> jax.Array:
        """The zeroed device pool, committed: an uncommitted array is a different jit cache
        key, and the first real step would recompile a bucket warm-up already compiled.
        Sharded, each device allocates only its own slice.

        On one CPU device the zeros come from the kernel (``native.lazy_zeros``): XLA's
        fill of the default 2 GiB pool faults in and writes every page, 1.5-3.5 s of CPU
        on the way to ready; zero pages cost nothing until a step first writes them."""
        n, device = self.num_device_pages, jax.devices()[0]
        sharding = parallel.pool_sharding(self.mesh) if self.mesh is not None \
            else jax.sharding.SingleDeviceSharding(device)
        zeros: Callable[[], jax.Array] = functools.partial(self.layout.zeros, n)
        if self._lazy_pool():
            zeros = functools.partial(native.lazy_zeros, self.layout.pool_shape(n),
                                      self.layout.dtype)
        return jax.jit(zeros, out_shardings=sharding)()

    def _lazy_pool(self) -> bool:
        """Whether ``_new_pool`` takes its zeros from the kernel (one CPU device, native
        ops built): such a pool's untouched pages cost no memory."""
        return (self.mesh is None and jax.devices()[0].platform == "cpu"
                and native.available())

    def _committed(self, value: np.ndarray) -> jax.Array:
        """``value`` placed where the step's outputs live (replicated under TP), so it
        hits the same compiled step as the arrays it stands in for."""
        return jax.device_put(value, self._constant_sharding())

    def _constant_sharding(self) -> jax.sharding.Sharding:
        """Where constants and the step's small outputs live: the one device, or
        replicated over the mesh under TP."""
        if self.mesh is None:
            return jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return parallel.replicated(self.mesh)

    def _new_duplex(self) -> DuplexKV:
        cfg = self.config
        if self.mesh is None:
            host = HostPool(self.num_host_pages, jax.devices()[0])  # the pool's device
            return DuplexKV(self.layout, self.kv, host, cfg.transfer_budget_pages,
                            copy_mode=cfg.copy_mode)
        host = HostPool(self.num_host_pages, page_sharding=parallel.page_sharding(self.mesh))
        return DuplexKV(self.layout, self.kv, host, cfg.transfer_budget_pages,
                        pool_sharding=parallel.pool_sharding(self.mesh),
                        copy_mode=cfg.copy_mode)

    def _executable_cache(self) -> ExecutableCache | None:
        """The serialized-executable cache (``superinfer_jax.runner.executable_cache``) beside
        the XLA cache, keyed also by what the step and resample close over: the engine
        config (less what no program reads), the model's plain attributes and class, the
        attention backend, the weights' tree and the mesh. None without a cache
        directory, and for a multi-process group (each process loads its own devices'
        programs; not validated there)."""
        cfg = self.config
        if not cfg.compilation_cache_dir or jax.process_count() > 1:
            return None
        model = self.model
        context = {
            "engine": cfg.replace(compilation_cache_dir=None, show_progress=True, warmup=True,
                                  compile_in_background=False, seed=0),
            "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
            "model": executable_cache.describe(model),
            "backend": self.backend,
            "feedback_width": self.feedback_width,
            "params": str(self._params_treedef),
            "mesh": repr(self.mesh),
        }
        return ExecutableCache.under(cfg.compilation_cache_dir, context)

    def _jit_step(self):
        """The jitted step, pool donated. Under TP the outputs are pinned: sampled tokens
        replicated (every process can read them) and the pool in its own sharding, so the
        donated buffer is reused and no step ever changes the pool's layout."""
        if self.mesh is None:
            return jax.jit(self._step, donate_argnums=(1,))
        replicated = parallel.replicated(self.mesh)
        out = (replicated, replicated, replicated, parallel.pool_sharding(self.mesh))
        return jax.jit(self._step, donate_argnums=(1,), out_shardings=out)

    def _jit_step_in_step(self):
        """The jitted step with DuplexKV's copies inside (``in_step`` copy mode), pool
        donated: the gathered pages are outputs in pinned_host (on GPU, XLA schedules
        them as asynchronous copy-start/copy-done beside the compute), the landed pages
        operands in pinned_host. Without a host tier it is never called."""
        if self.duplex is None:
            return jax.jit(self._step_in_step, donate_argnums=(1,))
        const = self._constant_sharding()
        # the placement promised to the compiles, not the pool's own: reading
        # ``kv_pool`` here would wait for its zeroing (2.7 s of a 6 s warm start)
        # before the ready set could even load
        pool = self.duplex.pool_sharding or self._pool_spec.sharding
        out = (const, const, const, pool, self.duplex.host.host_sharding)
        return jax.jit(self._step_in_step, donate_argnums=(1,), out_shardings=out)

    def _step_in_step(self, param_leaves, kv_pool, inputs: StepInputs,
                      sampling: SamplingInputs, logits_in: LogitsInputs,
                      feedback: TokenFeedback, out_ids, in_ids, in_pages):
        # Landed first (before the model could read them), gathered last, from pages
        # this step does not write (``duplexkv.rotation``: read before write).
        kv_pool = land_in_step(kv_pool, in_ids, in_pages)
        *out, kv_pool = self._step(param_leaves, kv_pool, inputs, sampling, logits_in,
                                   feedback)
        return (*out, kv_pool, gather_in_step(kv_pool, out_ids))

    def _choose_num_pages(self) -> int:
        cfg = self.config
        need_one = cfg.max_pages_per_seq + 1
        if cfg.num_device_pages is not None:
            pages = cfg.num_device_pages
        else:
            stats = jax.devices()[0].memory_stats() or {}
            if "bytes_limit" in stats:  # per device; a device holds 1/tp of each page
                free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
                shard_bytes = self.layout.page_bytes // cfg.tensor_parallel_size
                pages = int(free * cfg.device_memory_fraction) // shard_bytes
            else:
                want = cfg.max_num_seqs * cfg.max_pages_per_seq + 1
                pages = min(want, _CPU_DEFAULT_POOL_BYTES // self.layout.page_bytes)
            pages = max(pages, need_one)
        if pages < need_one:
            raise ValueError(
                f"num_device_pages ({pages}) cannot hold one request of max_model_len "
                f"{cfg.max_model_len} ({need_one} pages incl. the null page)"
            )
        return pages

    def _step(self, param_leaves, kv_pool, inputs: StepInputs, sampling: SamplingInputs,
              logits_in: LogitsInputs, feedback: TokenFeedback):
        params = jax.tree.unflatten(self._params_treedef, param_leaves)
        inputs = dataclasses.replace(inputs, tokens=apply_feedback(inputs.tokens, feedback))
        logits, kv_pool, hidden = self.model.forward(
            params, kv_pool, inputs, attention_backend=self.backend, return_hidden=True)
        processed = process_logits(logits, inputs, logits_in, self._eos_token_ids)
        sampled = sample(processed, sampling)
        logprob, rank, top_ids, top_lps = sampled_logprobs(logits, sampled, logits_in)
        prompt = prompt_logprobs(lambda h: self.model.project(params, h), hidden, logits_in)
        logprobs = StepLogprobs(logprob, rank, top_ids, top_lps, *prompt)
        return (pad_sampled(sampled, self.feedback_width), logprobs,
                deferred_logits(logits, logits_in), kv_pool)

    def _resample(self, rows: int, raw_logits, inputs: StepInputs, sampling: SamplingInputs,
                  logits_in: LogitsInputs):
        """Deferred sampling: rows of a step's raw logits, processed and sampled exactly
        as the step would have (same key, same position), with the mask the host could
        only compute once the row's previous token had landed."""
        raw_logits = raw_logits[:rows]  # the step hands out all its deferred slots
        processed = process_logits(raw_logits, inputs, logits_in, self._eos_token_ids)
        sampled = sample(processed, sampling)
        logprobs = StepLogprobs(*sampled_logprobs(raw_logits, sampled, logits_in),
                                *no_prompt_logprobs(raw_logits.shape[0], 1))
        return pad_sampled(sampled, self.feedback_width), logprobs

    def shapes(self) -> list[tuple[int, int]]:
        cfg = self.config
        shapes = [(b, 1) for b in cfg.decode_buckets]
        shapes += list(cfg.prefill_shapes)
        return shapes

    # -- warm-up -------------------------------------------------------------------------

    def warmup(self, background: bool = False) -> dict[str, float]:
        """Compile every program ahead of time (``superinfer_jax.runner.step_programs``), the
        smallest first, on one thread per core; returns each phase's seconds.

        ``background``: return once the ready set is compiled and run once; the rest
        compiles behind (``compiler``, ``limits`` grow as it does) and DuplexKV's copies
        are left to ``warm_duplex``. Else everything is compiled and run once (a
        multi-host follower compiles by replaying these runs), DuplexKV's copies too."""
        t0 = time.perf_counter()
        duplex = self.duplex.mover.buckets if self.duplex is not None else ()
        order = compile_order(self.config, self.resample_buckets, duplex)
        order += [Program(IN_STEP, shape) for shape in self.in_step_shapes()]  # last
        if background and self.step_programs.cache is not None:
            order.append(Program(REFILL, ()))  # last: after the hits it may refill
        first = ready_set(self.config) if background else order
        bar = tqdm(total=len(first), desc="compiling step buckets",
                   disable=not self.config.show_progress)
        self.duplex_warm = self.duplex is None
        if background:
            self.limits = self._compiled_limits()
        self._scratch_runs = background and self._lazy_pool()
        self._scratch_left = sum(p.kind == STEP and p not in first for p in order) \
            if self._scratch_runs else 0

        def compiled(program: Program) -> None:
            if background:
                self._publish_limits()
            if program in first:
                bar.update(1)
            elif self.compiler is not None:
                log.info("compiled %s in the background (%d left)", program,
                         self.compiler.num_left - 1)

        self.compiler = BucketCompiler(self._compile, order, len(first),
                                       default_num_threads(), background, compiled)
        try:
            self.compiler.wait_ready()
        finally:
            bar.close()
        t1 = time.perf_counter()
        cache = self.step_programs.cache
        if cache is not None:
            log.info("executable cache: %d programs loaded, %d compiled to ready",
                     cache.num_loaded, len(first) - cache.num_loaded)
        try:
            for program in first:
                self._run_once(program)
        finally:  # the engine is ready: compiles wait for a quiet moment from now on
            self.set_busy(False)
        t2 = time.perf_counter()
        times = {"step_buckets": t1 - t0, "first_runs": t2 - t1, "duplex": 0.0}
        if not background:
            times["duplex"] = self.warm_duplex()
        return times

    @property
    def duplex_compiled(self) -> bool:
        """Whether DuplexKV's copy programs are compiled (``warm_duplex`` is then quick)."""
        return self.compiler is None or self.compiler.compiled(DUPLEX)

    def warm_duplex(self) -> float:
        """Run DuplexKV's copy programs once (on the thread that owns the pool), compiled
        ahead by the compile threads; returns the seconds it took."""
        t0 = time.perf_counter()
        if self.duplex is not None and not self.duplex_warm:
            self.kv_pool = self.duplex.warmup(self.kv_pool)
        self.duplex_warm = True
        if self.compiler is not None:  # eager shadows may be planned from now on
            self._publish_limits()
        return time.perf_counter() - t0

    @property
    def compiling(self) -> bool:
        """Whether programs are still compiling in the background."""
        return self.compiler is not None and not self.compiler.done.is_set()

    def set_busy(self, busy: bool) -> None:
        """Tell the background compiles whether requests are in flight (they wait for
        the engine to idle, a bounded while, before starting the next compile)."""
        if self.compiler is not None and not self.compiler.done.is_set():
            self.compiler.set_busy(busy)

    def check_compiler(self) -> None:
        """Raise the error of a background compile that failed (the engine cannot serve
        every shape it was configured for)."""
        if self.compiler is not None and self.compiler.error is not None:
            raise RuntimeError(f"background compilation failed: {self.compiler.error}"
                               ) from self.compiler.error

    def _compile(self, program: Program) -> None:
        """Lower and compile one program from abstract arguments (worker threads: it
        reads no device array the engine thread may donate)."""
        if program.kind == STEP:
            self.step_programs.compile(*self._step_specs(*program.shape))
            if self._scratch_runs and program not in ready_set(self.config):
                self._first_run_on_scratch(*program.shape)
        elif program.kind == DUPLEX:
            assert self.duplex is not None  # only listed with a host tier
            self.duplex.mover.compile_ahead(self._pool_spec, program.shape[0])
        elif program.kind == IN_STEP:
            self.in_step_programs.compile(*self._in_step_specs(*program.shape))
        elif program.kind == REFILL:
            # Only the ready set, whose load is what a warm start waits for: after an
            # edit of the source every program comes from XLA's cache, and compiling
            # all ~20 again would be minutes of background CPU per edit.
            cache = self.step_programs.cache
            assert cache is not None  # only listed with a cache
            ready = {cache.key(STEP, self._step_specs(*p.shape))
                     for p in ready_set(self.config)}
            compiler = self.compiler
            stored = cache.refill(ready, stop=lambda: compiler is not None
                                  and compiler.cancelled.is_set())
            if stored:
                log.info("executable cache: stored %d ready programs XLA's cache had "
                         "served (compiled again)", stored)
        else:
            self.resample_programs.compile(*self._resample_specs(program.shape[0]))

    def _first_run_on_scratch(self, rows: int, cols: int) -> None:
        """Run the step program of ``[rows, cols]`` once on a scratch pool, on the compile
        thread, before its bucket is published: an XLA:CPU executable's first run pays a
        one-time cost that is not the pool's, and loaded from the executable cache it
        doubles the run (SmolLM2 on the 2-core CPU, first and second run: [1, 128] 650
        and 247 ms, [1, 256] 908 and 438, [8, 1] 358 and 61), so the first request to
        reach each bucket after a warm start took twice its TTFT. The cost is YNNPACK's
        (XLA:CPU's matmul fusions prepare at their first run): without YNN fusions
        (``--xla_cpu_experimental_ynn_fusion_type=``) there is none, but a bf16 decode
        step then takes 273 ms against 50. A first run on a
        scratch pool warms the executable for the real one ([4, 1]: 300 ms on scratch,
        then 59 ms on the pool), and the engine thread, which owns the pool, never waits
        for it. Only where the pool's zeros come from the kernel (``_lazy_pool``): the
        scratch pool then costs address space, not memory (the run writes the null
        page only). One scratch pool for every compile thread, dropped after the last
        step program's run (whatever compiles after it). A failure here is a warning: the
        bucket is published all the same, and its first real run pays the cost."""
        with self._scratch_lock:
            self._scratch_left -= 1
            try:
                pool = self._scratch_pool
                if pool is None:  # placed as the programs were compiled for (DuplexKV's)
                    pool = jax.device_put(self._new_pool(), self._pool_spec.sharding)
                self._scratch_pool = None  # donated below
                out = self.step_programs(self.step_params, pool,
                                         self.null_page_inputs(rows, cols),
                                         SamplingInputs.greedy(rows),
                                         self.neutral_logits_inputs(rows, cols),
                                         TokenFeedback.none(rows, self.no_tokens))
                jax.block_until_ready(out)
            except Exception:
                log.warning("first run of step %dx%d on a scratch pool failed; its first "
                            "request pays it", rows, cols, exc_info=True)
                return
            if self._scratch_left > 0:
                self._scratch_pool = out[3]

    def _run_once(self, program: Program) -> None:
        """Run a compiled program once on empty inputs (its first run pays one-time
        costs; it only writes the null page). DuplexKV's copies run in ``warm_duplex``;
        in_step variants run first when a step takes copies."""
        if program.kind == STEP:
            rows, cols = program.shape
            self.call_step(self.null_page_inputs(rows, cols),
                           SamplingInputs.greedy(rows)).block_until_ready()
        elif program.kind == RESAMPLE:
            jax.block_until_ready(self.resample(self._resample_warmup_logits(),
                                                [None] * program.shape[0]))

    def _step_specs(self, rows: int, cols: int) -> tuple:
        """The step's arguments at one shape, as the engine passes them: device arrays
        as abstract values with their placement, host inputs as numpy."""
        neutral = neutral_logits_inputs(rows, cols, self.config.max_model_len,
                                        self.model.vocab_size, self.config.deferred_rows)
        no_tokens = self._constant_spec(np.zeros(self.feedback_width, np.int32))
        return (self.step_params, self._pool_spec, self.empty_inputs(rows, cols),
                SamplingInputs.greedy(rows), jax.tree.map(self._constant_spec, neutral),
                TokenFeedback.none(rows, cast(jax.Array, no_tokens)))  # abstract, as is

    def _in_step_specs(self, rows: int, cols: int, num_out: int, num_in: int) -> tuple:
        assert self.duplex is not None  # only listed with a host tier
        page = jax.ShapeDtypeStruct(self.kv_pool.shape[1:], self.kv_pool.dtype,
                                    sharding=self.duplex.host.host_sharding)
        return (*self._step_specs(rows, cols), np.zeros(num_out, np.int32),
                np.zeros(num_in, np.int32), (page,) * num_in)

    def in_step_shapes(self) -> list[tuple[int, int, int, int]]:
        """The in_step variants compiled: (rows, 1, pages out, pages in) for every decode
        bucket, with ``B = in_step_pages`` pages out, in, or both ways (3 per decode
        bucket; 18 in the default config, compiled last, in the background). A step's
        copies ride the step only when its first call is a decode call and a direction
        has at least ``B`` pages; then ``B`` pages go in the step and the rest by the
        separate programs. Every other step copies by the separate programs (as in
        ``fused`` mode): one count bucket per direction keeps the compiles bounded."""
        if self.duplex is None or not self.duplex.in_step:
            return []
        b = self.config.in_step_pages
        return [(rows, 1, o, i) for rows in self.config.decode_buckets
                for o, i in ((b, 0), (0, b), (b, b))]

    def _resample_specs(self, rows: int) -> tuple:
        zeros = np.zeros((rows, 1), np.int32)
        context = np.zeros(rows, np.int32)
        neutral = neutral_logits_inputs(rows, 1, self.config.max_model_len,
                                        self.model.vocab_size, self.config.deferred_rows)
        logits = self._constant_spec(np.zeros((self.config.deferred_rows,
                                               self.model.vocab_size), np.float32))
        return (rows, logits, StepInputs.from_numpy(zeros, zeros, context, context, zeros),
                SamplingInputs.greedy(rows), jax.tree.map(self._constant_spec, neutral))

    def _constant_spec(self, value: np.ndarray) -> jax.ShapeDtypeStruct:
        """What ``_committed(value)`` is, abstractly."""
        return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=self._constant_sharding())

    def _compiled_limits(self) -> BucketLimits:
        return bucket_limits(self.config, self.step_programs.compiled,
                             self.resample_programs.compiled, self.resample_buckets,
                             self.duplex_warm)

    def _publish_limits(self) -> None:
        with self._limits_lock:  # two compiles may finish at once: the later set wins
            self.limits = self._compiled_limits()

    def empty_inputs(self, rows: int, cols: int, num_tokens: int = 0) -> StepInputs:
        """A call on the null page only (which only padding reads or writes), each row
        with ``num_tokens`` real tokens: 0, every row padding (argument specs, lowering);
        ``cols``, what warm-up's first runs use (``null_page_inputs``)."""
        return StepInputs.from_numpy(
            tokens=np.zeros((rows, cols)),
            positions=np.broadcast_to(np.arange(cols) if num_tokens else 0, (rows, cols)),
            query_lens=np.full(rows, num_tokens),
            context_lens=np.full(rows, num_tokens),
            page_tables=np.full((rows, self.config.max_pages_per_seq), NULL_PAGE),
        )

    def null_page_inputs(self, rows: int, cols: int) -> StepInputs:
        """Every row runs ``cols`` real tokens on the null page: warm-up's first run goes
        through the attention's page loop, so the first request does not pay for entering
        it the first time (XLA:CPU: ~70 ms of SmolLM2's first real prefill after a run
        with no context)."""
        return self.empty_inputs(rows, cols, num_tokens=cols)

    # -- dispatch ------------------------------------------------------------------------

    def dispatch(self, rows: list[tuple[Request, int]], prefill: bool,
                 page_table: Callable[[str], list[int]]) -> Dispatched:
        """Build one padded call from ``rows`` (request, tokens this step) and dispatch
        it behind the step in flight. A row whose inputs cannot be built is reported in
        ``failed`` and left as padding; the others run."""
        cfg = self.config
        if prefill:
            num_rows = bucket(len(rows), cfg.prefill_row_buckets)
            # at least the shortest compiled chunk (``compilation``: before ready's
            # background compiles reach the short buckets)
            cols = self.limits.prefill_columns(
                bucket(max(n for _, n in rows), cfg.prefill_chunk_buckets))
        else:
            num_rows, cols = bucket(len(rows), cfg.decode_buckets), 1
        tokens = np.zeros((num_rows, cols), np.int32)
        positions = np.zeros((num_rows, cols), np.int32)
        query_lens = np.zeros(num_rows, np.int32)
        context_lens = np.zeros(num_rows, np.int32)
        page_tables = np.full((num_rows, cfg.max_pages_per_seq), NULL_PAGE, np.int32)
        temperature = np.zeros(num_rows, np.float32)
        top_k = np.zeros(num_rows, np.int32)
        top_p = np.ones(num_rows, np.float32)
        seeds = np.zeros(num_rows, np.uint32)
        source = np.full(num_rows, NO_SOURCE, np.int32)
        arrays = (tokens, positions, query_lens, context_lens, page_tables, temperature, top_k,
                  top_p, seeds, source)
        padding = (0, 0, 0, 0, NULL_PAGE, 0, 0, 1, 0, NO_SOURCE)  # each array's fill
        kept: list[tuple[Request, int]] = []
        failed: list[tuple[Request, BaseException]] = []
        extra = _LogitsRows(self, num_rows, cols)
        deferred: list[int] = []
        b = 0
        for req, n in rows:
            try:
                start = req.num_computed_tokens
                known = req.all_token_ids[start:start + n]
                tokens[b, :len(known)] = known
                if len(known) < n:
                    source[b] = self._feedback_source(req, n, len(known))
                positions[b, :n] = np.arange(start, start + n)
                query_lens[b] = n
                context_lens[b] = start + n
                table = page_table(req.req_id)
                if len(table) * cfg.page_size < start + n:  # would read the null page
                    raise RuntimeError(f"request {req.req_id!r} holds {len(table)} pages for "
                                       f"{start + n} tokens")
                page_tables[b, :len(table)] = table
                sp = req.sampling
                temperature[b], top_k[b], top_p[b] = sp.temperature, sp.top_k, sp.top_p
                seeds[b] = sp.seed or 0
                # a grammar's mask needs the token in flight: sampled later (``resample``)
                defer = req.grammar is not None and len(known) < n
                if defer and len(deferred) == cfg.deferred_rows:
                    raise RuntimeError(f"more than {cfg.deferred_rows} deferred rows")
                sampled_here = start + n == req.num_tokens and not defer
                extra.set_row(b, req, start, n, mask=req.grammar is not None and sampled_here)
                if defer:
                    deferred.append(b)
            except Exception as e:  # this request's inputs only: it fails, the step goes on
                for a, pad in zip(arrays, padding, strict=True):
                    a[b] = pad
                extra.clear_row(b)
                failed.append((req, e))
                continue
            kept.append((req, n))
            b += 1
        if not kept:
            return Dispatched(None, None, kept, failed)
        inputs = StepInputs.from_numpy(tokens, positions, query_lens, context_lens, page_tables)
        sampling = SamplingInputs(temperature, top_k, top_p, seeds, context_lens.copy())
        prev = self.inflight or InflightStep()
        feedback = TokenFeedback(source, *(self.no_tokens if a is None else a
                                           for a in (prev.prefill, prev.decode, prev.deferred)))
        if deferred:
            extra.defer(deferred)
        sampled = self.call_step(inputs, sampling, feedback, extra.build())
        return Dispatched(sampled, self.last_logprobs if extra.any_logprobs else None, kept,
                          failed, deferred, self.last_deferred_logits if deferred else None)

    def resample(self, raw_logits: jax.Array, reqs: Sequence[Request | None]
                 ) -> tuple[jax.Array, StepLogprobs | None]:
        """Sample the deferred rows of a dispatched step (``raw_logits``, slot ``j`` for
        ``reqs[j]``), now that each request's previous token has landed and its grammar
        gives the mask. Returns the padded tokens (a feedback source for the next step)
        and their logprobs when one asked."""
        rows = bucket(max(len(reqs), 1), self.resample_buckets)
        context = np.zeros(rows, np.int32)
        temperature = np.zeros(rows, np.float32)
        top_k = np.zeros(rows, np.int32)
        top_p = np.ones(rows, np.float32)
        seeds = np.zeros(rows, np.uint32)
        extra = _LogitsRows(self, rows, 1)
        for j, req in enumerate(reqs):
            if req is None:  # warm-up: an empty slot
                continue
            # every token before the sampled position is on the host now: all history
            position = req.num_computed_tokens
            context[j] = position
            sp = req.sampling
            temperature[j], top_k[j], top_p[j] = sp.temperature, sp.top_k, sp.top_p
            seeds[j] = sp.seed or 0
            extra.set_row(j, req, position, 0, mask=True)
        zeros = np.zeros((rows, 1), np.int32)
        inputs = StepInputs.from_numpy(zeros, zeros, np.zeros(rows), context, zeros)
        sampling = SamplingInputs(temperature, top_k, top_p, seeds, context.copy())
        sampled, logprobs = self._resample_fn(rows, raw_logits, inputs, sampling,
                                              extra.build())
        return sampled, logprobs if extra.any_logprobs else None

    def _resample_warmup_logits(self) -> jax.Array:
        return self._committed(np.zeros((self.config.deferred_rows, self.model.vocab_size),
                                        np.float32))

    def _feedback_source(self, req: Request, n: int, num_known: int) -> int:
        """Where a row's unknown input token lies: the one token the step in flight is
        sampling for ``req``. Anything else is a scheduling bug, not a data race."""
        prev = self.inflight
        if n != 1 or num_known != 0 or prev is None or req.req_id not in prev.sources:
            raise RuntimeError(
                f"request {req.req_id!r} was scheduled {n} token(s) from position "
                f"{req.num_computed_tokens} but the host knows only {len(req.all_token_ids)} "
                "and no step in flight samples the missing one")
        return prev.sources[req.req_id]

    def call_step(self, inputs: StepInputs, sampling: SamplingInputs,
                  feedback: TokenFeedback | None = None,
                  logits_in: LogitsInputs | None = None) -> jax.Array:
        """Run the jitted step on the pool (donated); returns the padded sampled tokens
        (the call's logprobs, when ``logits_in`` asks for them, are ``last_logprobs``)."""
        rows, cols = inputs.tokens.shape
        if feedback is None:
            feedback = TokenFeedback.none(rows, self.no_tokens)
        if logits_in is None:
            logits_in = self.neutral_logits_inputs(rows, cols)
        copies = self._take_copies(inputs)
        if copies is None:
            sampled, self.last_logprobs, self.last_deferred_logits, self.kv_pool = (
                self._step_fn(self.step_params, self.kv_pool, inputs, sampling, logits_in,
                              feedback))
            return sampled
        assert self.duplex is not None
        (sampled, self.last_logprobs, self.last_deferred_logits, self.kv_pool,
         out_pages) = self.in_step_programs(self.step_params, self.kv_pool, inputs, sampling,
                                            logits_in, feedback, copies.out_ids,
                                            copies.in_ids, copies.in_pages)
        self._rotation_events += self.duplex.finish_in_step(out_pages)
        return sampled

    def _written_pages(self, inputs: StepInputs) -> set[int]:
        """Every page a call on ``inputs`` may write KV to (a superset: every column of
        every row, padding included): the pages of its positions in its page tables."""
        tables, positions = np.asarray(inputs.page_tables), np.asarray(inputs.positions)
        index = np.clip(positions // self.config.page_size, 0, tables.shape[1] - 1)
        return set(np.take_along_axis(tables, index, axis=1).ravel().tolist())

    def _take_copies(self, inputs: StepInputs) -> StepCopies | None:
        """The copies the call about to be dispatched makes in its own program (in_step
        mode), else None; copies left by ``poll_rotations`` and ``issue_rotations`` that
        it does not take are made now, by the separate programs, before the call."""
        if self.duplex is None or not self.duplex.has_deferred:
            return None
        rows, cols = inputs.tokens.shape
        b = self.config.in_step_pages
        written = self._written_pages(inputs)
        num_out, num_in = self.duplex.in_step_pending(written)
        shape = (rows, cols, b if num_out >= b else 0, b if num_in >= b else 0)
        if shape[2:] != (0, 0) and self._in_step_ready(shape):
            self.kv_pool, copies = self.duplex.take_in_step(self.kv_pool, *shape[2:], written)
            return copies
        self.flush_rotations(keep_events=True)
        return None

    def _in_step_ready(self, shape: tuple[int, int, int, int]) -> bool:
        """Whether the in_step variant of ``shape`` may run: compiled ahead, or warm-up
        is off (every call then compiles on first use, as the plain step does)."""
        if shape in self.in_step_programs.compiled:
            return True
        return not self.config.warmup and shape in self.in_step_shapes()

    def neutral_logits_inputs(self, rows: int, cols: int) -> LogitsInputs:
        """Logits inputs that change nothing, committed once per shape (no transfer)."""
        key = (rows, cols)
        if key not in self._neutral:
            neutral = neutral_logits_inputs(rows, cols, self.config.max_model_len,
                                            self.model.vocab_size, self.config.deferred_rows)
            self._neutral[key] = jax.tree.map(self._committed, neutral)
        return self._neutral[key]

    # -- DuplexKV on the pool ----------------------------------------------------------

    def poll_rotations(self) -> list[RotationEvent]:
        """Finished page copies, observed without waiting; arrived pages land in the pool."""
        if self.duplex is None:
            return []
        self.kv_pool, events = self.duplex.poll(self.kv_pool, defer=self._defer_copies)
        return events

    def issue_rotations(self, moves_out: list[PageMoves], moves_in: list[PageMoves],
                        shadows: list[PageMoves]) -> list[RotationEvent]:
        """Issue a plan's copies, before the step that donates the pool is dispatched;
        returns the copies that failed at once."""
        if self.duplex is None:
            return []
        return self.duplex.execute(self.kv_pool, moves_out, moves_in, shadows,
                                   defer=self._defer_copies)

    @property
    def _defer_copies(self) -> bool:
        """in_step mode: the step's copies wait for its first call, which may make them
        in its own program (``flush_rotations`` makes what no call took). Not under
        multi-host lockstep, which replays only the calls it records."""
        return (self.duplex is not None and self.duplex.in_step
                and self._step_fn is self.step_programs)

    def flush_rotations(self, keep_events: bool = False) -> list[RotationEvent]:
        """After a step's calls are dispatched: make the copies no call took (no call
        ran), and return the failures of copies issued with the calls."""
        if self.duplex is not None and self.duplex.has_deferred:
            self.kv_pool, events = self.duplex.flush(self.kv_pool)
            self._rotation_events += events
        if keep_events:
            return []
        events, self._rotation_events = self._rotation_events, []
        return events

    def cancel_rotations(self, req_id: str) -> None:
        if self.duplex is not None:
            self.duplex.cancel(req_id)

    @staticmethod
    def read_tokens(sampled: jax.Array) -> np.ndarray:
        """The sampled token ids on the host: blocks on this call only."""
        return parallel.host_value(sampled)


class _LogitsRows:
    """The ``LogitsInputs`` of one call, built row by row: each feature's wide arrays are
    made only once a row uses it; the others stay the runner's committed constants."""

    def __init__(self, runner: ModelRunner, rows: int, cols: int):
        self.runner, self.rows, self.cols = runner, rows, cols
        self.small = {
            "prompt_lens": np.zeros(rows, np.int32),
            "presence": np.zeros(rows, np.float32),
            "frequency": np.zeros(rows, np.float32),
            "repetition": np.ones(rows, np.float32),
            "suppress_eos": np.zeros(rows, np.bool_),
            "masked": np.zeros(rows, np.bool_),
            "want_logprobs": np.zeros(rows, np.bool_),
            "want_prompt_logprobs": np.zeros(rows, np.bool_),
        }
        self.wide: dict[str, np.ndarray] = {}  # history, bias_*, mask, targets once used
        self.any_logprobs = False

    def _wide(self, name: str) -> np.ndarray:
        if name not in self.wide:
            neutral = self.runner.neutral_logits_inputs(self.rows, self.cols)
            self.wide[name] = np.array(getattr(neutral, name))  # a writable host copy
        return self.wide[name]

    def set_row(self, b: int, req: Request, start: int, n: int, mask: bool) -> None:
        """Row ``b`` computes ``n`` tokens of ``req`` from ``start`` (0: it only samples
        position ``start``); ``mask``: it samples under its grammar's current mask."""
        sp = req.sampling
        num_prompt = len(req.prompt_token_ids)
        self.small["prompt_lens"][b] = num_prompt
        if sp.has_penalties:
            self.small["presence"][b] = sp.presence_penalty
            self.small["frequency"][b] = sp.frequency_penalty
            self.small["repetition"][b] = sp.repetition_penalty
            known = req.all_token_ids[:start]  # every position before the step is known
            self._wide("history")[b, :len(known)] = known
        # the output index of the token this row samples (when it is the last row)
        outputs_before = start + n - num_prompt
        bias = list(sp.logit_bias)
        if outputs_before < sp.min_tokens:
            self.small["suppress_eos"][b] = True
            bias += [(t, -np.inf) for t in sp.stop_token_ids]
        if bias:
            ids, values = zip(*bias, strict=True)
            self._wide("bias_ids")[b, :len(ids)] = ids
            self._wide("bias_values")[b, :len(values)] = values
        if mask:
            self.small["masked"][b] = True
            req.grammar.fill_bitmask(self._wide("mask")[b])
        if sp.logprobs is not None:
            self.small["want_logprobs"][b] = self.any_logprobs = True
        if sp.prompt_logprobs is not None and start + 1 < num_prompt:
            self.small["want_prompt_logprobs"][b] = self.any_logprobs = True
            targets = req.prompt_token_ids[start + 1:min(start + n + 1, num_prompt)]
            self._wide("targets")[b, :len(targets)] = targets

    def defer(self, rows: list[int]) -> None:
        """These rows' sampling is deferred: the step hands out their raw logits."""
        deferred = np.full(self.runner.config.deferred_rows, -1, np.int32)
        deferred[:len(rows)] = rows
        self.small["deferred_rows"] = deferred

    def clear_row(self, b: int) -> None:
        """A row whose inputs failed half-way becomes neutral padding again."""
        neutral = self.runner.neutral_logits_inputs(1, self.cols)
        for name, array in (*self.small.items(), *self.wide.items()):
            if name != "deferred_rows":  # per call, not per row
                array[b] = np.asarray(getattr(neutral, name))[0]

    def build(self) -> LogitsInputs:
        """The call's inputs. What stands in for a committed constant (the wide arrays,
        ``deferred_rows``) is committed too, so every call of a shape passes its arguments
        committed alike whichever features its rows use: jit keys its cache on that, and
        without an executable per shape (warm-up off) each mix compiled the step again."""
        neutral = self.runner.neutral_logits_inputs(self.rows, self.cols)
        small = dict(self.small)
        placed = dict(self.wide)
        if "deferred_rows" in small:
            placed["deferred_rows"] = small.pop("deferred_rows")
        if placed:
            placed = jax.device_put(placed, self.runner._constant_sharding())
        return dataclasses.replace(neutral, **small, **placed)



def enable_compilation_cache(path: str) -> None:
    """Persist compiled steps on disk: a restart (or a second engine) skips XLA compiles."""
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
