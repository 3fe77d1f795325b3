"""Compile and warm-up orchestration for one ``ModelRunner`` (as tpu-inference's
``CompilationManager``): which programs compile in which order (``step_programs``), their
abstract arguments, their first runs, and the ``BucketLimits`` the scheduler plans within
while the rest compile in the background."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, cast

import jax
import numpy as np
from tqdm.auto import tqdm

from superinfer_jax.config import BucketLimits
from superinfer_jax.kv.layout import NULL_PAGE
from superinfer_jax.model_api import StepInputs
from superinfer_jax.runner.logits import neutral_logits_inputs
from superinfer_jax.runner.sampling import SamplingInputs
from superinfer_jax.runner.step_programs import (
    DUPLEX,
    REFILL,
    RESAMPLE,
    STEP,
    BucketCompiler,
    Program,
    bucket_limits,
    compile_order,
    default_num_threads,
    ready_set,
)
from superinfer_jax.runner.token_feedback import TokenFeedback

if TYPE_CHECKING:
    from superinfer_jax.runner.model_runner import ModelRunner

IN_STEP = "in_step"  # a Program kind: the decode step with DuplexKV's copies inside
log = logging.getLogger(__name__)


class CompilationManager:
    """Compiles the runner's programs ahead of time and publishes what may run."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.config = runner.config
        # what the scheduler may plan: with background compiles, what is compiled so far
        self.limits: BucketLimits = self.config.bucket_limits
        self.compiler: BucketCompiler | None = None
        self.duplex_warm = True  # DuplexKV's copy programs compiled (or none to compile)
        self._limits_lock = threading.Lock()
        # background step programs run once on a scratch pool before they are published
        self._scratch_runs = False
        self._scratch_left = 0  # step programs still to run on the scratch pool
        self._scratch_pool: jax.Array | None = None
        self._scratch_lock = threading.Lock()


    def program_order(self, in_step: bool = True) -> list[Program]:
        """Every program of the runner, in the order they compile (``in_step``: with the
        in_step variants, last)."""
        runner = self.runner
        duplex = runner.duplex.mover.buckets if runner.duplex is not None else ()
        order = compile_order(self.config, runner.resample_buckets, duplex)
        if in_step:
            order += [Program(IN_STEP, shape) for shape in self.in_step_shapes()]
        return order

    def warmup(self, background: bool = False) -> dict[str, float]:
        """Compile every program ahead of time, the smallest first, and run each once;
        returns each phase's seconds. ``background``: return once the ready set is
        compiled and run; the rest compiles behind (``limits`` grow) and DuplexKV's
        copies are left to ``warm_duplex``."""
        t0 = time.perf_counter()
        order = self.program_order()
        if background and self.runner.step_programs.cache is not None:
            order.append(Program(REFILL, ()))  # last: after the hits it may refill
        first = ready_set(self.config) if background else order
        self._start(order, first, background)
        t1 = time.perf_counter()
        cache = self.runner.step_programs.cache
        if cache is not None:
            log.info("executable cache: %d programs loaded, %d compiled to ready",
                     cache.num_loaded, len(first) - cache.num_loaded)
        try:
            for program in first:
                self._run_once(program)
        finally:  # the engine is ready: compiles wait for a quiet moment from now on
            self.set_busy(False)
        times = {"step_buckets": t1 - t0, "first_runs": time.perf_counter() - t1,
                 "duplex": 0.0}
        if not background:
            times["duplex"] = self.warm_duplex()
        return times

    def _start(self, order: list[Program], first: list[Program], background: bool) -> None:
        """Start the compile threads on ``order`` and wait for ``first``."""
        bar = tqdm(total=len(first), desc="compiling step buckets",
                   disable=not self.config.show_progress)
        self.duplex_warm = self.runner.duplex is None
        if background:
            self.limits = self._compiled_limits()
        self._scratch_runs = background and self.runner.pool.lazy
        self._scratch_left = sum(p.kind == STEP and p not in first for p in order) \
            if self._scratch_runs else 0

        def compiled(program: Program) -> None:
            if background:
                self.publish_limits()
            if program in first:
                bar.update(1)
            elif self.compiler is not None:
                log.info("compiled %s in the background (%d left)", program,
                         self.compiler.num_left - 1)

        self.compiler = BucketCompiler(self.compile_program, order, len(first),
                                       default_num_threads(), background, compiled)
        try:
            self.compiler.wait_ready()
        finally:
            bar.close()

    def compile_ahead(self) -> BucketCompiler:
        """Compile the programs ``warmup`` compiles (less the in_step variants, which
        lockstep never runs), without running any: a multi-host follower runs only what
        process 0 sends."""
        order = self.program_order(in_step=False)
        return BucketCompiler(self.compile_program, order, len(order),
                              default_num_threads(), background=False)

    @property
    def duplex_compiled(self) -> bool:
        """Whether DuplexKV's copy programs are compiled (``warm_duplex`` is then quick)."""
        return self.compiler is None or self.compiler.compiled(DUPLEX)

    def warm_duplex(self) -> float:
        """Run DuplexKV's copy programs once (on the thread that owns the pool), compiled
        ahead by the compile threads; returns the seconds it took."""
        t0 = time.perf_counter()
        runner = self.runner
        if runner.duplex is not None and not self.duplex_warm:
            runner.kv_pool = runner.duplex.warmup(runner.kv_pool)
        self.duplex_warm = True
        if self.compiler is not None:  # eager shadows may be planned from now on
            self.publish_limits()
        return time.perf_counter() - t0

    @property
    def compiling(self) -> bool:
        """Whether programs are still compiling in the background."""
        return self.compiler is not None and not self.compiler.done.is_set()

    def set_busy(self, busy: bool) -> None:
        """Tell the background compiles whether requests are in flight (they wait for
        the engine to idle, a bounded while, before starting the next compile)."""
        if self.compiling:
            assert self.compiler is not None
            self.compiler.set_busy(busy)

    def check(self) -> None:
        """Raise the error of a background compile that failed (the engine cannot serve
        every shape it was configured for)."""
        if self.compiler is not None and self.compiler.error is not None:
            raise RuntimeError(f"background compilation failed: {self.compiler.error}"
                               ) from self.compiler.error

    def wait_done(self) -> None:
        if self.compiler is not None:
            self.compiler.wait_done()

    def cancel(self, wait_s: float) -> bool:
        """Compile nothing more; False when a compile still runs after ``wait_s``."""
        return self.compiler is None or self.compiler.cancel(wait_s)


    def compile_program(self, program: Program) -> None:
        """Lower and compile one program from abstract arguments (worker threads: it
        reads no device array the engine thread may donate)."""
        runner = self.runner
        if program.kind == STEP:
            runner.step_programs.compile(*self.step_specs(*program.shape))
            if self._scratch_runs and program not in ready_set(self.config):
                self.first_run_on_scratch(*program.shape)
        elif program.kind == DUPLEX:
            assert runner.duplex is not None  # only listed with a host tier
            runner.duplex.mover.compile_ahead(runner.pool.spec, program.shape[0])
        elif program.kind == IN_STEP:
            runner.in_step_programs.compile(*self.in_step_specs(*program.shape))
        elif program.kind == REFILL:
            self._refill()
        else:
            runner.resample_programs.compile(*self.resample_specs(program.shape[0]))

    def _refill(self) -> None:
        """Store in the executable cache the ready set's programs XLA's cache served (only
        those: a warm start waits for their load)."""
        cache = self.runner.step_programs.cache
        assert cache is not None  # only listed with a cache
        ready = {cache.key(STEP, self.step_specs(*p.shape)) for p in ready_set(self.config)}
        compiler = self.compiler
        stored = cache.refill(ready, stop=lambda: compiler is not None
                              and compiler.cancelled.is_set())
        if stored:
            log.info("executable cache: stored %d ready programs XLA's cache had "
                     "served (compiled again)", stored)

    def first_run_on_scratch(self, rows: int, cols: int) -> None:
        """Run the step program of ``[rows, cols]`` once on a scratch pool, on the compile
        thread, before its bucket is published: an XLA:CPU executable's first run pays a
        one-time cost, which then no request pays. Only with ``DevicePool.lazy`` zeros
        (the scratch pool costs address space, not memory); one scratch pool, dropped
        after the last step program. A failure is a warning: the bucket is published."""
        runner = self.runner
        with self._scratch_lock:
            self._scratch_left -= 1
            try:
                pool = self._scratch_pool
                if pool is None:  # placed as the programs were compiled for (DuplexKV's)
                    pool = jax.device_put(runner.pool.zeros(), runner.pool.spec.sharding)
                self._scratch_pool = None  # donated below
                out = runner.step_programs(runner.step_params, pool,
                                           self.null_page_inputs(rows, cols),
                                           SamplingInputs.greedy(rows),
                                           runner.neutral_logits_inputs(rows, cols),
                                           TokenFeedback.none(rows, runner.no_tokens))
                jax.block_until_ready(out)
            except Exception:
                log.warning("first run of step %dx%d on a scratch pool failed; its first "
                            "request pays it", rows, cols, exc_info=True)
                return
            if self._scratch_left > 0:
                self._scratch_pool = out[3]

    def _run_once(self, program: Program) -> None:
        """Run a compiled step or resample once on the null page (its first run pays
        one-time costs). DuplexKV's copies run in ``warm_duplex``."""
        runner = self.runner
        if program.kind == STEP:
            rows, cols = program.shape
            runner.call_step(self.null_page_inputs(rows, cols),
                             SamplingInputs.greedy(rows)).block_until_ready()
        elif program.kind == RESAMPLE:
            jax.block_until_ready(runner.resample(self.resample_warmup_logits(),
                                                  [None] * program.shape[0]))


    def in_step_shapes(self) -> list[tuple[int, int, int, int]]:
        """The in_step variants: (rows, 1, pages out, pages in) for every decode bucket,
        with ``B = in_step_pages`` pages out, in, or both ways (a step carries ``B`` pages
        of a direction that has that many; the rest go by the separate programs)."""
        duplex = self.runner.duplex
        if duplex is None or not duplex.in_step:
            return []
        b = self.config.duplex_kv.in_step_pages
        return [(rows, 1, o, i) for rows in self.config.decode_buckets
                for o, i in ((b, 0), (0, b), (b, b))]

    def step_specs(self, rows: int, cols: int) -> tuple:
        """The step's arguments at one shape, as the engine passes them: device arrays
        as abstract values with their placement, host inputs as numpy."""
        runner, cfg = self.runner, self.config
        neutral = neutral_logits_inputs(rows, cols, cfg.model.max_model_len,
                                        runner.model.vocab_size, cfg.deferred_rows)
        no_tokens = self._constant_spec(np.zeros(runner.feedback_width, np.int32))
        return (runner.step_params, runner.pool.spec, self.empty_inputs(rows, cols),
                SamplingInputs.greedy(rows), jax.tree.map(self._constant_spec, neutral),
                TokenFeedback.none(rows, cast(jax.Array, no_tokens)))  # abstract, as is

    def in_step_specs(self, rows: int, cols: int, num_out: int, num_in: int) -> tuple:
        runner = self.runner
        assert runner.duplex is not None  # only listed with a host tier
        pool = runner.kv_pool
        page = jax.ShapeDtypeStruct(pool.shape[1:], pool.dtype,
                                    sharding=runner.duplex.host.host_sharding)
        return (*self.step_specs(rows, cols), np.zeros(num_out, np.int32),
                np.zeros(num_in, np.int32), (page,) * num_in)

    def resample_specs(self, rows: int) -> tuple:
        cfg, vocab = self.config, self.runner.model.vocab_size
        zeros = np.zeros((rows, 1), np.int32)
        context = np.zeros(rows, np.int32)
        neutral = neutral_logits_inputs(rows, 1, cfg.model.max_model_len, vocab, cfg.deferred_rows)
        logits = self._constant_spec(np.zeros((cfg.deferred_rows, vocab), np.float32))
        return (rows, logits, StepInputs.from_numpy(zeros, zeros, context, context, zeros),
                SamplingInputs.greedy(rows), jax.tree.map(self._constant_spec, neutral))

    def resample_warmup_logits(self) -> jax.Array:
        shape = (self.config.deferred_rows, self.runner.model.vocab_size)
        return self.runner.committed(np.zeros(shape, np.float32))

    def _constant_spec(self, value: np.ndarray) -> jax.ShapeDtypeStruct:
        """What ``ModelRunner.committed(value)`` is, abstractly."""
        return jax.ShapeDtypeStruct(value.shape, value.dtype,
                                    sharding=self.runner.constant_sharding())

    def empty_inputs(self, rows: int, cols: int, num_tokens: int = 0) -> StepInputs:
        """A call on the null page only, each row with ``num_tokens`` real tokens (0: all
        padding, for argument specs)."""
        return StepInputs.from_numpy(
            tokens=np.zeros((rows, cols)),
            positions=np.broadcast_to(np.arange(cols) if num_tokens else 0, (rows, cols)),
            query_lens=np.full(rows, num_tokens),
            context_lens=np.full(rows, num_tokens),
            page_tables=np.full((rows, self.config.max_pages_per_seq), NULL_PAGE),
        )

    def null_page_inputs(self, rows: int, cols: int) -> StepInputs:
        """Every row runs ``cols`` real tokens on the null page: warm-up's first run goes
        through the attention's page loop, so the first request does not."""
        return self.empty_inputs(rows, cols, num_tokens=cols)


    def _compiled_limits(self) -> BucketLimits:
        runner = self.runner
        return bucket_limits(self.config, runner.step_programs.compiled,
                             runner.resample_programs.compiled, runner.resample_buckets,
                             self.duplex_warm)

    def publish_limits(self) -> None:
        with self._limits_lock:  # two compiles may finish at once: the later set wins
            self.limits = self._compiled_limits()
