"""Start-up compilation (``superinfer_jax.runner.step_programs``): the engine serves once its
smallest buckets are compiled, keeps every call within what is compiled while the rest
compiles, never compiles inside a step, and generates the same greedy tokens as an
engine that compiled everything first."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import jax.monitoring
import numpy as np
import pytest

from superinfer_jax import EngineConfig, LLMEngine, SamplingParams
from superinfer_jax.async_engine import AsyncEngine
from superinfer_jax.config import BucketLimits
from superinfer_jax.config_schema import ConfigError
from superinfer_jax.kv.layout import NULL_PAGE
from superinfer_jax.ops import native
from superinfer_jax.runner.step_programs import (
    REFILL,
    RESAMPLE,
    STEP,
    BucketCompiler,
    Program,
    bucket_limits,
    compile_order,
    ready_set,
)
from tests.superinfer_jax.engine_testlib import run_jobs

REPO = Path(__file__).resolve().parents[2]

# decode 1/2/4 rows; prefill [1, 16], [2, 16], [1, 32]; deferred sampling 1/2/4 rows;
# ready: [1, 1] and [1, 32] (the default ready_prefill_chunk)
CFG = EngineConfig.build(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                         max_prefill_chunk=32, max_prefill_rows=2, page_size=8,
                         show_progress=False)
CFG16 = CFG.replace(ready_prefill_chunk=16)  # ready with the shortest chunk


@contextmanager
def compiles_on(thread_name: str | None = None) -> Iterator[list[str]]:
    """JAX's tracing, lowering, compile and compilation-cache events recorded on the
    thread named ``thread_name`` (None: the calling thread); background compile threads
    record theirs on their own."""
    me = threading.get_ident()
    events: list[str] = []

    def listener(name: str, *args, **kwargs) -> None:
        here = threading.current_thread()
        mine = here.ident == me if thread_name is None else here.name == thread_name
        if mine and name.startswith(("/jax/core/compile/", "/jax/compilation_cache/")):
            events.append(f"{name} {kwargs.get('fun_name', '')}".strip())

    jax.monitoring.register_event_duration_secs_listener(listener)
    jax.monitoring.register_event_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        jax.monitoring.unregister_event_listener(listener)


def jobs() -> list:
    rng = np.random.default_rng(3)
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    return [(rng.integers(0, 250, size=int(n)).tolist(), sp) for n in (45, 3, 20, 31, 9)]


@pytest.mark.parametrize("cfg,chunk", [(CFG, 32), (CFG16, 16)])
def test_order_starts_with_the_ready_set_and_covers_every_program(cfg, chunk):
    order = compile_order(cfg, (1, 2, 4))
    assert order[:2] == ready_set(cfg) == [Program(STEP, (1, 1)), Program(STEP, (1, chunk))]
    steps = [p.shape for p in order if p.kind == STEP]
    assert sorted(steps) == sorted([(b, 1) for b in cfg.decode_buckets]
                                   + list(cfg.prefill_shapes))
    assert [p.shape for p in order if p.kind == RESAMPLE] == [(1,), (2,), (4,)]
    assert len(set(order)) == len(order)


@pytest.mark.parametrize("ready,want", [(1, 16), (16, 16), (17, 32), (32, 32), (33, 64),
                                        (256, 256), (10_000, 256)])
def test_the_ready_chunk_is_a_bucket_no_longer_than_the_longest_chunk(ready, want):
    cfg = EngineConfig.build(ready_prefill_chunk=ready)  # chunk buckets 16 ... 256
    assert cfg.ready_chunk_bucket == want
    assert ready_set(cfg)[1] == Program(STEP, (1, want))


def test_a_bad_ready_chunk_names_the_field():
    with pytest.raises(ConfigError) as e:
        EngineConfig.build(ready_prefill_chunk=0)
    assert e.value.key == "ready_prefill_chunk"


def test_limits_grow_around_a_ready_chunk_that_is_not_the_shortest():
    """Ready with [1, 64] of 16 ... 256: chunks from 64 up, padded to 64, until [1, 16]
    and [1, 32] are compiled; the run must hold the ready chunk and have no gap."""
    cfg = EngineConfig.build(ready_prefill_chunk=64, max_num_seqs=4)
    resample = (1, 2, 4)

    def limits(steps):
        return bucket_limits(cfg, frozenset(steps), frozenset(), resample)

    assert limits([(1, 1), (1, 64)]) == BucketLimits(1, 1, 64, 0, min_prefill_chunk=64)
    assert limits([(1, 1), (1, 64)]).prefill_columns(16) == 64
    assert limits([(1, 1), (1, 64)]).prefill_columns(128) == 128
    # [1, 16] without [1, 32] leaves a gap: a 20-token chunk would pad to a missing 32
    assert limits([(1, 1), (1, 16), (1, 64), (1, 128)]) == BucketLimits(
        1, 1, 128, 0, min_prefill_chunk=64)
    done = limits([(1, 1), (1, 16), (1, 32), (1, 64)])
    assert done == BucketLimits(1, 1, 64, 0) and done.prefill_columns(16) == 16
    # no ready chunk (a caller compiling its own shapes): the run from the shortest
    assert limits([(1, 1), (1, 16), (1, 32)]) == BucketLimits(1, 1, 32, 0)


def test_limits_are_the_compiled_buckets_below_the_first_gap():
    def limits(steps, resamples=()):
        return bucket_limits(CFG16, frozenset(steps), frozenset(resamples), (1, 2, 4))

    assert limits([]) == BucketLimits(0, 0, 0, 0)
    assert limits([(1, 1), (1, 16)]) == BucketLimits(1, 1, 16, 0)  # [2, 16] still missing
    assert limits([(1, 1), (1, 16), (2, 16)]) == BucketLimits(1, 2, 16, 0)
    # [4, 1] without [2, 1] is not usable: a 2-row call would pad to a missing bucket
    assert limits([(1, 1), (4, 1), (1, 16), (1, 32)]).decode_rows == 1
    assert limits([(1, 1), (1, 16), (1, 32)]) == BucketLimits(1, 1, 32, 0)
    full = [(1, 1), (2, 1), (4, 1), (1, 16), (2, 16), (1, 32)]
    assert limits(full, [(1,), (2,), (4,)]) == CFG16.bucket_limits
    assert limits(full, [(2,)]).deferred_rows == 0


def test_requests_run_in_compiled_buckets_while_the_rest_compile(tiny):
    """Compiles past the ready set are held until the requests are done: every call
    is [1, 1] or [1, 32] (prompts split into 32-token chunks, shorter chunks padded to
    32, one decode row a step), nothing compiles on the engine's thread, and the greedy
    tokens equal those of an engine that compiled every bucket first."""
    want = run_jobs(LLMEngine(tiny, CFG), jobs())
    engine = LLMEngine(tiny, CFG.replace(warmup=False, compile_in_background=True))
    gate = threading.Event()
    compile_one = engine.runner.compilation.compile_program

    def held(program: Program) -> None:
        if program not in ready_set(CFG):
            gate.wait()
        compile_one(program)

    engine.runner.compilation.compile_program = held  # type: ignore[method-assign]
    engine.warmup()
    shapes: list[tuple[int, int]] = []
    step_fn = engine.runner._step_fn

    def recorded_call(*args):
        shapes.append(args[2].tokens.shape)
        return step_fn(*args)

    engine.runner._step_fn = recorded_call
    try:
        assert engine.runner.limits == BucketLimits(1, 1, 32, 0, min_prefill_chunk=32)
        assert engine.warmup_pending
        seen = []
        step = engine.step

        def recorded_step():
            out = step()
            seen.append((engine.last_stats.num_prefill_tokens,
                         engine.last_stats.num_decode_tokens))
            return out

        engine.step = recorded_step  # type: ignore[method-assign]
        with compiles_on() as events:
            got = run_jobs(engine, jobs())
        assert events == []
        assert max(p for p, _ in seen) == 32 and max(d for _, d in seen) == 1
        assert set(shapes) == {(1, 1), (1, 32)}  # the 3- and 9-token prompts padded
        assert engine.runner.step_programs.num_fallback_calls == 0
    finally:
        gate.set()
        engine.runner._step_fn = step_fn
    engine.runner.compiler.wait_done(timeout=600)
    assert engine.runner.limits == CFG.bucket_limits
    assert [r.output_token_ids for r in got] == [r.output_token_ids for r in want]


@pytest.mark.skipif(not native.available(), reason="the scratch pool needs lazy zeros "
                    "(native ops not built on this machine)")
@pytest.mark.parametrize("cached", [False, True])
def test_background_step_programs_run_once_on_a_scratch_pool_before_publication(
        tiny, tmp_path, cached):
    """Each step program compiled past the ready set is run once on a scratch pool on its
    compile thread, before its bucket enters the limits (a loaded executable's first run
    is twice its steady one); the engine's pool is not touched, the scratch pool is
    dropped after the last step program (also when other programs follow it: with a
    cache, the refill compiles last), and a failed scratch run still publishes its
    bucket."""
    cache = str(tmp_path) if cached else None
    engine = LLMEngine(tiny, CFG.replace(warmup=False, compile_in_background=True,
                                         compilation_cache_dir=cache))
    runner = engine.runner
    background = [p.shape for p in compile_order(CFG, runner.resample_buckets)
                  if p.kind == STEP and p not in ready_set(CFG)]
    runs: list[tuple[tuple[int, int], BucketLimits, str]] = []
    first_run, inputs = runner.compilation.first_run_on_scratch, runner.compilation.null_page_inputs
    steps_run = threading.Event()  # the refill waits for it: programs follow the last step

    def recorded(rows: int, cols: int) -> None:
        runs.append(((rows, cols), runner.limits, threading.current_thread().name))
        first_run(rows, cols)
        if len(runs) == len(background):
            steps_run.set()

    def failing(rows: int, cols: int):
        if (rows, cols) == (2, 1):  # only its scratch run asks for it (the engine idles)
            raise RuntimeError("no inputs")
        return inputs(rows, cols)

    runner.compilation.first_run_on_scratch = recorded  # type: ignore[method-assign]
    runner.compilation.null_page_inputs = failing  # type: ignore[method-assign]
    gate = threading.Event()
    compile_one = runner.compilation.compile_program

    def held(program: Program) -> None:
        if program not in ready_set(CFG):
            gate.wait()
        if program.kind == REFILL:
            steps_run.wait(600)
        compile_one(program)

    runner.compilation.compile_program = held  # type: ignore[method-assign]
    engine.warmup()
    assert [p.kind for p in runner.compiler._programs][-1] == (REFILL if cached else STEP)
    pool = np.asarray(runner.kv_pool).copy()
    gate.set()
    runner.set_busy(False)
    assert runner.compiler.wait_done(timeout=600)
    assert sorted(shape for shape, _, _ in runs) == sorted(background)
    for (rows, cols), limits, thread in runs:
        assert thread.startswith("compile-")
        if cols == 1:
            assert limits.decode_rows < rows  # not yet published
        else:
            assert (rows, cols) not in runner.step_programs.compiled or \
                limits.prefill_chunk < cols or limits.prefill_rows < rows \
                or limits.min_prefill_chunk > cols
    assert runner.limits == CFG.bucket_limits  # [2, 1] too, its scratch run failed
    assert runner.compilation._scratch_pool is None
    np.testing.assert_array_equal(np.asarray(runner.kv_pool), pool)


def test_served_after_ready_while_idle_work_finishes_warm_up(tiny, tmp_path):
    """A server's loop: ready after the smallest buckets, a request served at once, and
    the deferred warm-up (the other buckets, DuplexKV's copies, the latency profile)
    finishes while it idles; the engine's thread traces none of the engine's programs
    (the profile's own host-to-device timing makes a small array there). Eager shadows
    on: the scheduler plans none until DuplexKV's copies are compiled and warm
    (``BucketLimits.copies``), so the first request does not compile them inline."""
    profile = tmp_path / "profile.json"
    cfg = CFG.replace(compile_in_background=True, policy="rotasched", num_host_pages=32,
                      eager_shadowing=True)
    cfg = cfg.replace(rotasched=cfg.rotasched.__class__(latency_profile=str(profile)))
    engine = LLMEngine(tiny, cfg)
    assert engine.latency is None and engine.warmup_pending
    assert not engine.runner.limits.copies
    with compiles_on("engine-loop") as events:
        loop = AsyncEngine(engine)
        try:
            prompt, sp = jobs()[0]
            first = list(loop.submit(prompt, sp))[-1]
            deadline = time.monotonic() + 600
            while engine.warmup_pending and time.monotonic() < deadline:
                time.sleep(0.05)
        except BaseException:
            loop.stop()
            raise
    programs = ("_step", "_resample", "_gather", "_scatter", "_scatter_from_host")
    assert [e for e in events if e.endswith(programs)] == []
    try:
        assert not engine.warmup_pending
        assert engine.latency is not None and profile.exists()
        assert engine.runner.duplex_warm and engine.runner.limits == cfg.bucket_limits
        later = list(loop.submit(prompt, sp))[-1]
        assert later.request.output_token_ids == first.request.output_token_ids
        assert engine.runner.step_programs.num_fallback_calls == 0
    finally:
        loop.stop()


def _compiler(quiet_s: float, busy_wait_s: float) -> tuple[BucketCompiler, list[Program]]:
    programs = [Program(STEP, (1, c)) for c in (1, 16, 32, 64)]
    compiled: list[Program] = []
    compiler = BucketCompiler(compiled.append, programs, num_ready=1, num_threads=1,
                              background=True, quiet_s=quiet_s, busy_wait_s=busy_wait_s)
    return compiler, compiled


def test_background_compiles_wait_for_a_quiet_engine():
    """Past the ready set nothing compiles until the engine says it is idle (after its
    first runs) or while it serves; once idle for ``quiet_s``, the rest compiles."""
    compiler, compiled = _compiler(quiet_s=0.05, busy_wait_s=3600)
    compiler.wait_ready()
    time.sleep(0.2)
    compiler.set_busy(True)  # a request in flight
    time.sleep(0.2)
    assert compiled == [Program(STEP, (1, 1))]
    assert not compiler.done.is_set()
    compiler.set_busy(False)
    assert compiler.wait_done(timeout=600)
    assert len(compiled) == 4


def test_a_busy_engine_does_not_starve_the_compiles():
    compiler, compiled = _compiler(quiet_s=3600, busy_wait_s=0.05)
    compiler.wait_ready()
    compiler.set_busy(True)  # and never idle again
    assert compiler.wait_done(timeout=600)
    assert len(compiled) == 4


def test_cancel_releases_waiting_compile_threads():
    compiler, compiled = _compiler(quiet_s=3600, busy_wait_s=3600)
    compiler.wait_ready()
    compiler.cancel()
    for t in compiler._threads:
        t.join(timeout=600)
        assert not t.is_alive()
    assert compiled == [Program(STEP, (1, 1))]


def test_cancel_waits_for_the_compile_under_way():
    """A stopping server must not exit while a thread is inside XLA's compiler (the
    process would abort instead of exiting with its code): ``cancel(wait_s)`` returns
    once the compile under way has finished, and nothing after it starts."""
    started, release = threading.Event(), threading.Event()
    compiled: list[Program] = []

    def compile_one(program: Program) -> None:
        if program.shape != (1, 1):
            started.set()
            release.wait(600)
        compiled.append(program)

    programs = [Program(STEP, (1, c)) for c in (1, 16, 32)]
    compiler = BucketCompiler(compile_one, programs, num_ready=1, num_threads=1,
                              background=True, quiet_s=0.0, busy_wait_s=0.0)
    compiler.set_busy(False)
    assert started.wait(600)
    assert compiler.cancel(wait_s=0.05) is False  # still inside the [1, 16] compile
    threading.Timer(0.2, release.set).start()
    assert compiler.cancel(wait_s=600) is True
    assert compiled == [Program(STEP, (1, 1)), Program(STEP, (1, 16))]


def test_no_background_compile_starts_before_the_ready_set_is_compiled():
    """Two threads, two ready programs: the thread that finishes [1, 1] first does not
    take [1, 32] while [1, 16] still compiles (it would take a core from it)."""
    release = threading.Event()
    started: list[Program] = []
    ready_then: list[bool] = []
    compiler: BucketCompiler | None = None

    def compile_one(program: Program) -> None:
        started.append(program)
        if program.shape == (1, 16):
            release.wait(600)
        if compiler is not None:
            ready_then.append(compiler.ready.is_set())

    programs = [Program(STEP, (1, c)) for c in (1, 16, 32, 64)]
    compiler = BucketCompiler(compile_one, programs, num_ready=2, num_threads=2,
                              background=True, quiet_s=0.0, busy_wait_s=0.0)
    compiler.set_busy(False)
    deadline = time.monotonic() + 600
    while len(started) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # time for a thread that would not wait to start [1, 32]
    assert started == programs[:2] and not compiler.ready.is_set()
    release.set()
    assert compiler.wait_done(timeout=600)
    assert sorted(started[2:], key=str) == sorted(programs[2:], key=str)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_bad_value_names_the_field(value):
    with pytest.raises(ConfigError) as e:
        EngineConfig.build(compile_in_background=value)
    assert e.value.key == "compile_in_background"


@pytest.mark.parametrize("host_pages", [0, 16])
def test_the_pool_is_zeroed_off_the_callers_thread_and_placed_as_compiled(tiny, host_pages):
    """The pool is built on its own thread (its zeroing overlaps the ready set's
    compiles); its first read waits for it: all zeros, placed as the programs were
    compiled for (with and without DuplexKV's host tier, which re-places it)."""
    engine = LLMEngine(tiny, CFG.replace(warmup=False, num_host_pages=host_pages))
    runner = engine.runner
    pool = runner.kv_pool
    assert runner.pool.thread.name == "kv-pool" and not runner.pool.thread.is_alive()
    assert pool.shape == runner.pool.spec.shape and pool.dtype == runner.pool.spec.dtype
    assert pool.sharding == runner.pool.spec.sharding
    assert not np.asarray(pool).any()


def test_a_pool_that_failed_to_allocate_is_an_error_at_its_first_read(tiny, monkeypatch):
    from superinfer_jax.runner.device_pool import DevicePool

    def fail(self):
        raise MemoryError("no room for the pool")

    monkeypatch.setattr(DevicePool, "zeros", fail)
    engine = LLMEngine(tiny, CFG.replace(warmup=False))
    with pytest.raises(RuntimeError, match="allocating the KV pool failed: no room"):
        _ = engine.runner.kv_pool


def test_a_script_that_never_reads_the_pool_exits_cleanly(tmp_path):
    """A short script builds an engine (no warm-up, so nothing waits for the pool) and
    ends: the interpreter joins the pool thread instead of tearing it down inside XLA's
    fill, which aborted the process (exit 134, "FATAL: exception not rethrown")."""
    script = tmp_path / "build_and_exit.py"
    script.write_text(
        "from models.servable import random_servable\n"
        "from superinfer_jax import EngineConfig, LLMEngine\n"
        "from tests.superinfer_jax.engine_testlib import TINY\n"
        "LLMEngine(random_servable(TINY, seed=1), EngineConfig.build(\n"
        "    max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,\n"
        "    max_prefill_chunk=16, page_size=8, num_device_pages=4096,\n"
        "    show_progress=False, warmup=False))\n"
        "print('built', flush=True)\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(script)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "built"
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "FATAL" not in proc.stderr and "terminate called" not in proc.stderr


def test_first_runs_go_through_the_page_loop_on_the_null_page_only(tiny, monkeypatch):
    """Warm-up's first run of each step gives every row real tokens on the null page, so
    the attention's page loop has run before the first request (entering it the first
    time cost SmolLM2's first real prefill ~70 ms, 2x its steady TTFT). It writes the
    null page and no other, and greedy tokens are those of an engine that never ran it."""
    from superinfer_jax.runner.model_runner import ModelRunner

    calls: list[tuple[int, int, int]] = []  # (rows, fewest query tokens, least context)
    call_step = ModelRunner.call_step

    def recorded(self, inputs, *args, **kwargs):
        calls.append((int(inputs.tokens.shape[0]), int(np.min(inputs.query_lens)),
                      int(np.min(inputs.context_lens))))
        return call_step(self, inputs, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "call_step", recorded)
    warm = LLMEngine(tiny, CFG)
    monkeypatch.undo()
    assert len(calls) == len(warm.runner.shapes())  # one first run per step bucket
    assert all(q >= 1 and c >= 1 for _, q, c in calls), calls
    pool = np.asarray(warm.runner.kv_pool)
    assert pool[NULL_PAGE].any()  # the first runs wrote K and V there
    assert not pool[:NULL_PAGE].any() and not pool[NULL_PAGE + 1:].any()
    rng = np.random.default_rng(4)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    jobs = [(rng.integers(0, 250, size=int(n)).tolist(), sp) for n in (5, 19, 40)]
    cold = LLMEngine(tiny, CFG.replace(warmup=False))
    assert ([r.output_token_ids for r in run_jobs(warm, jobs)]
            == [r.output_token_ids for r in run_jobs(cold, jobs)])
