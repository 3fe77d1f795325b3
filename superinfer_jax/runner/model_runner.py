"""The model runner: everything that lives on the device, behind one object.

It owns the device state and the calls on it, as vLLM V1's model runner does: the model
placed on its mesh (one device, or tensor-parallel), the paged KV pool (``DevicePool``),
the DuplexKV rotation engine that copies the pool's pages to and from the host tier, the
jitted step with the pool donated, building a step's padded inputs from scheduled rows
(``input_batch``), and the token feedback of asynchronous scheduling (the step in
flight). Compiling and warming up its programs is its ``CompilationManager``'s job.
Nothing in here decides who runs or what a token means: the scheduler plans, the output
processor interprets, ``LLMEngine`` narrates.

Blast radius: building one row's inputs can fail for that request alone (an out-of-range
value that slipped past validation, a missing page table); ``dispatch`` reports it and
pads the row instead of raising, so the rest of the batch runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

import superinfer_jax.ops as ops
from superinfer_jax.config import BucketLimits, EngineConfig, bucket
from superinfer_jax.dist import parallel
from superinfer_jax.duplexkv import DuplexKV, RotationEvent
from superinfer_jax.duplexkv.mover import gather_in_step, land_in_step
from superinfer_jax.duplexkv.rotation import StepCopies
from superinfer_jax.kv.host_pool import HostPool, num_host_pages_for
from superinfer_jax.kv.layout import PoolLayout
from superinfer_jax.kv.two_tier import PageMoves, TwoTierKVManager
from superinfer_jax.model_api import ServableModel, StepInputs
from superinfer_jax.request import Request
from superinfer_jax.runner.compilation_manager import CompilationManager
from superinfer_jax.runner.device_pool import (
    DevicePool,
    check_backend_dtype,
    check_pools_fit,
    choose_num_pages,
)
from superinfer_jax.runner.executable_cache import ExecutableCache
from superinfer_jax.runner.input_batch import (
    CallArrays,
    Dispatched,
    InflightStep,
    LogitsRows,
)
from superinfer_jax.runner.kv_calibration import kv_scales_for
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
from superinfer_jax.runner.step_programs import RESAMPLE, STEP, BucketCompiler, Programs
from superinfer_jax.runner.token_feedback import TokenFeedback, apply_feedback, pad_sampled


class ModelRunner:
    """Device state and the calls on it, for one engine."""

    def __init__(self, model: ServableModel, config: EngineConfig):
        self.config = config
        if config.hardware.compilation_cache_dir:
            enable_compilation_cache(config.hardware.compilation_cache_dir)
        tp = config.model.tensor_parallel_size
        self.mesh = parallel.make_mesh(tp) if tp > 1 else None  # None: one device
        self.model = model = parallel.place_model(model, self.mesh)
        self.layout = PoolLayout(model.kv_spec, config.hardware.page_size,
                                 config.model.kv_cache_dtype)
        self.num_device_pages = choose_num_pages(config, self.layout)
        self.num_host_pages = num_host_pages_for(
            config.duplex_kv.host_memory_gb, config.duplex_kv.num_host_pages,
                                                 self.layout.page_bytes)
        check_pools_fit(config, self.layout, self.num_device_pages, self.num_host_pages)
        self.backend = ops.resolve_backend(config.hardware.attention_backend)
        check_backend_dtype(config, self.backend)
        # the pages' bookkeeping (host only): the scheduler plans with it
        self.kv = TwoTierKVManager(
            self.num_device_pages, config.hardware.page_size, self.num_host_pages,
            prefix_caching=config.prefix_caching.enabled,
            host_cache_eviction=config.prefix_caching.host_eviction,
            host_cache_max_pages=config.prefix_caching.host_max_pages)
        self.duplex: DuplexKV | None = None  # the rotation engine, when a host tier exists
        if self.num_host_pages > 0:
            self.duplex = self._new_duplex()
        self.pool = DevicePool(self.layout, self.num_device_pages, self.mesh, self.duplex)
        self.feedback_width = max(config.decode_buckets + config.prefill_row_buckets)
        self.no_tokens = self.committed(np.zeros(self.feedback_width, np.int32))
        self._inflight: InflightStep | None = None  # dispatched, tokens not read yet
        self.last_logprobs: StepLogprobs | None = None  # of the last call_step
        self.last_deferred_logits: jax.Array | None = None
        # the weights as a flat list: jit flattens its arguments at every call, and a list
        # is cheaper to flatten than the nnx.State
        self.step_params, self._params_treedef = jax.tree.flatten(self.model.params)
        self._num_weights = len(self.step_params)
        # fp8_e4m3's fixed KV scales ride as the last "weight": an argument of every step
        # program, never a constant baked into a cached executable
        self.kv_scales = kv_scales_for(model, self.layout, config.model.max_model_len,
                                       self.mesh)
        self.step_params += [] if self.kv_scales is None else [self.kv_scales]
        self._eos_token_ids = tuple(int(t) for t in model.eos_token_ids)
        self._neutral: dict[tuple[int, int], LogitsInputs] = {}  # (rows, cols) -> committed
        cache = ExecutableCache.for_runner(config, model, self.backend, self.feedback_width,
                                           self._params_treedef, self.mesh)
        self.step_programs = Programs(self._jit_step(), key=lambda a: a[2].tokens.shape,
                                      cache=cache, name=STEP)
        # in_step copy mode: per (step shape, pages out, pages in)
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
        self.compilation = CompilationManager(self)

    # -- setup -------------------------------------------------------------------------

    @property
    def kv_pool(self) -> jax.Array:
        """The device KV pool; the first read waits for its allocation."""
        return self.pool.array

    @kv_pool.setter
    def kv_pool(self, pool: jax.Array) -> None:
        self.pool.array = pool

    def committed(self, value: np.ndarray) -> jax.Array:
        """``value`` placed where the step's outputs live (replicated under TP), so it
        hits the same compiled step as the arrays it stands in for."""
        return jax.device_put(value, self.constant_sharding())

    def constant_sharding(self) -> jax.sharding.Sharding:
        """Where constants and the step's small outputs live: the one device, or
        replicated over the mesh under TP."""
        if self.mesh is None:
            return jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return parallel.replicated(self.mesh)

    def _new_duplex(self) -> DuplexKV:
        cfg = self.config
        if self.mesh is None:
            host = HostPool(self.num_host_pages, jax.devices()[0])  # the pool's device
            return DuplexKV(self.layout, self.kv, host, cfg.duplex_kv.transfer_budget_pages,
                            copy_mode=cfg.duplex_kv.copy_mode)
        host = HostPool(self.num_host_pages, page_sharding=parallel.page_sharding(self.mesh))
        return DuplexKV(self.layout, self.kv, host, cfg.duplex_kv.transfer_budget_pages,
                        pool_sharding=parallel.pool_sharding(self.mesh),
                        copy_mode=cfg.duplex_kv.copy_mode)

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
        donated: gathered pages out and landed pages in, both in pinned_host (on GPU, XLA
        overlaps the copies with the compute)."""
        if self.duplex is None:
            return jax.jit(self._step_in_step, donate_argnums=(1,))
        const = self.constant_sharding()
        # the placement promised to the compiles: reading ``kv_pool`` would wait for
        # its zeroing before the ready set could load
        pool = self.duplex.pool_sharding or self.pool.spec.sharding
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

    def _step(self, param_leaves, kv_pool, inputs: StepInputs, sampling: SamplingInputs,
              logits_in: LogitsInputs, feedback: TokenFeedback):
        n = self._num_weights
        params = jax.tree.unflatten(self._params_treedef, param_leaves[:n])
        scales = {"kv_scales": param_leaves[n]} if self.layout.scaled else {}
        inputs = dataclasses.replace(inputs, tokens=apply_feedback(inputs.tokens, feedback))
        logits, kv_pool, hidden = self.model.forward(
            params, kv_pool, inputs, attention_backend=self.backend, return_hidden=True,
            **scales)
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

    # -- compilation (``CompilationManager``) ------------------------------------------

    def warmup(self, background: bool = False) -> dict[str, float]:
        """Compile every program ahead of time and run each once; returns each phase's
        seconds (``CompilationManager.warmup``)."""
        return self.compilation.warmup(background)

    @property
    def limits(self) -> BucketLimits:
        """What the scheduler may plan: what is compiled so far."""
        return self.compilation.limits

    @property
    def compiler(self) -> BucketCompiler | None:
        return self.compilation.compiler

    @property
    def duplex_warm(self) -> bool:
        return self.compilation.duplex_warm

    @property
    def duplex_warmup_due(self) -> bool:
        """Whether DuplexKV's copy programs are compiled but not yet run once."""
        return not self.compilation.duplex_warm and self.compilation.duplex_compiled

    def warm_duplex(self) -> float:
        return self.compilation.warm_duplex()

    @property
    def compiling(self) -> bool:
        return self.compilation.compiling

    def set_busy(self, busy: bool) -> None:
        self.compilation.set_busy(busy)

    def check_compiler(self) -> None:
        self.compilation.check()

    def wait_compiled(self) -> None:
        """Block until every background compile is done."""
        self.compilation.wait_done()

    def stop_compiling(self, wait_s: float) -> bool:
        return self.compilation.cancel(wait_s)

    # -- dispatch ------------------------------------------------------------------------

    def dispatch(self, rows: list[tuple[Request, int]], prefill: bool,
                 page_table: Callable[[str], list[int]]) -> Dispatched:
        """Build one padded call from ``rows`` (request, tokens this step) and dispatch
        it behind the step in flight. A row whose inputs cannot be built is reported in
        ``failed`` and left as padding; the others run."""
        cfg = self.config
        if prefill:
            num_rows = bucket(len(rows), cfg.prefill_row_buckets)
            # at least the shortest compiled chunk
            cols = self.limits.prefill_columns(
                bucket(max(n for _, n in rows), cfg.prefill_chunk_buckets))
        else:
            num_rows, cols = bucket(len(rows), cfg.decode_buckets), 1
        arrays = CallArrays(num_rows, cols, cfg.max_pages_per_seq)
        extra = LogitsRows(num_rows, cols, self.neutral_logits_inputs,
                           self.constant_sharding(), cfg.deferred_rows)
        kept: list[tuple[Request, int]] = []
        failed: list[tuple[Request, BaseException]] = []
        deferred: list[int] = []
        for req, n in rows:
            b = len(kept)
            try:
                defer = self._set_row(arrays, extra, b, req, n, page_table, len(deferred))
            except Exception as e:  # this request's inputs only: it fails, the step goes on
                arrays.clear_row(b)
                extra.clear_row(b)
                failed.append((req, e))
                continue
            kept.append((req, n))
            if defer:
                deferred.append(b)
        if not kept:
            return Dispatched(None, None, kept, failed)
        prev = self._inflight or InflightStep()
        feedback = TokenFeedback(arrays.source, *(
            self.no_tokens if a is None else a
            for a in (prev.prefill, prev.decode, prev.deferred)))
        if deferred:
            extra.defer(deferred)
        sampled = self.call_step(arrays.inputs(), arrays.sampling(), feedback, extra.build())
        # where each row's token lies for the next step's feedback (``token_feedback``)
        width = self.feedback_width
        sources = [(0 if prefill else width) + b for b in range(len(kept))]
        for j, b in enumerate(deferred):  # sampled by ``resample``: the third array
            sources[b] = 2 * width + j
        return Dispatched(sampled, self.last_logprobs if extra.any_logprobs else None, kept,
                          failed, deferred, self.last_deferred_logits if deferred else None,
                          sources)

    def _set_row(self, arrays: CallArrays, extra: LogitsRows, b: int, req: Request, n: int,
                 page_table: Callable[[str], list[int]], num_deferred: int) -> bool:
        """Fill row ``b`` with ``n`` tokens of ``req``; returns whether its sampling is
        deferred. Raises when the row cannot be built."""
        cfg = self.config
        start = req.num_computed_tokens
        known = req.all_token_ids[start:start + n]
        arrays.tokens[b, :len(known)] = known
        if len(known) < n:
            arrays.source[b] = self._feedback_source(req, n, len(known))
        arrays.positions[b, :n] = np.arange(start, start + n)
        arrays.query_lens[b] = n
        arrays.context_lens[b] = start + n
        table = page_table(req.req_id)
        if len(table) * cfg.hardware.page_size < start + n:  # would read the null page
            raise RuntimeError(f"request {req.req_id!r} holds {len(table)} pages for "
                               f"{start + n} tokens")
        arrays.page_tables[b, :len(table)] = table
        arrays.set_sampling(b, req)
        # a grammar's mask needs the token in flight: sampled later (``resample``)
        defer = req.grammar is not None and len(known) < n
        if defer and num_deferred == cfg.deferred_rows:
            raise RuntimeError(f"more than {cfg.deferred_rows} deferred rows")
        sampled_here = start + n == req.num_tokens and not defer
        extra.set_row(b, req, start, n, mask=req.grammar is not None and sampled_here)
        return defer

    @property
    def has_step_in_flight(self) -> bool:
        """Whether a dispatched step's tokens have not been handed to the host yet."""
        return self._inflight is not None

    def put_in_flight(self, step: InflightStep | None) -> InflightStep | None:
        """Make ``step`` the step in flight, whose sampled tokens the next dispatch reads
        on the device; returns the step it replaces (its tokens are for the host now)."""
        done, self._inflight = self._inflight, step
        return done

    def resample(self, raw_logits: jax.Array, reqs: Sequence[Request | None]
                 ) -> tuple[jax.Array, StepLogprobs | None]:
        """Sample the deferred rows of a dispatched step (``raw_logits``, slot ``j`` for
        ``reqs[j]``) under each grammar's mask, now that their previous tokens landed;
        returns the padded tokens (fed back to the next step) and logprobs if asked."""
        rows = bucket(max(len(reqs), 1), self.resample_buckets)
        context = np.zeros(rows, np.int32)
        temperature = np.zeros(rows, np.float32)
        top_k = np.zeros(rows, np.int32)
        top_p = np.ones(rows, np.float32)
        seeds = np.zeros(rows, np.uint32)
        extra = LogitsRows(rows, 1, self.neutral_logits_inputs, self.constant_sharding(),
                           self.config.deferred_rows)
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

    def _feedback_source(self, req: Request, n: int, num_known: int) -> int:
        """Where a row's unknown input token lies: the one token the step in flight is
        sampling for ``req``. Anything else is a scheduling bug, not a data race."""
        prev = self._inflight
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
        index = np.clip(positions // self.config.hardware.page_size, 0, tables.shape[1] - 1)
        return set(np.take_along_axis(tables, index, axis=1).ravel().tolist())

    def _take_copies(self, inputs: StepInputs) -> StepCopies | None:
        """The copies the call about to be dispatched makes in its own program (in_step
        mode), else None; the copies it does not take are made now, before the call."""
        if self.duplex is None or not self.duplex.has_deferred:
            return None
        rows, cols = inputs.tokens.shape
        b = self.config.duplex_kv.in_step_pages
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
        return not self.config.engine.warmup and shape in self.compilation.in_step_shapes()

    def neutral_logits_inputs(self, rows: int, cols: int) -> LogitsInputs:
        """Logits inputs that change nothing, committed once per shape (no transfer)."""
        key = (rows, cols)
        if key not in self._neutral:
            neutral = neutral_logits_inputs(rows, cols, self.config.model.max_model_len,
                                            self.model.vocab_size, self.config.deferred_rows)
            self._neutral[key] = jax.tree.map(self.committed, neutral)
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
        in its own program; not under multi-host lockstep (it replays recorded calls)."""
        return (self.duplex is not None and self.duplex.in_step
                and self._step_fn is self.step_programs)

    def flush_rotations(self, keep_events: bool = False) -> list[RotationEvent]:
        """After a step's calls are dispatched: make the copies no call took, and return
        the failures of copies issued with the calls."""
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


def enable_compilation_cache(path: str) -> None:
    """Persist compiled steps on disk: a restart (or a second engine) skips XLA compiles."""
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
