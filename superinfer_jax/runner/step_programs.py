"""Start-up compilation: each call shape compiled ahead of time, smallest first, on
several threads, and a step that never compiles.

The engine's device programs are jitted functions specialised per shape bucket: the
model step per ``[rows, columns]`` (15 buckets in the default config) and deferred
sampling (``ModelRunner.resample``) per row bucket. Each bucket is a full XLA compile,
seconds on a CPU. ``Programs`` holds one ahead-of-time executable per shape
(``jit(f).lower(...).compile()``) and is called like the jitted function: a call finds
its executable by shape, so once a shape is compiled nothing on the call path traces,
lowers or compiles. ``BucketCompiler`` compiles a list of programs in priority order on
worker threads: XLA's compiler releases the GIL, so two compiles run on two cores at once
(tracing and lowering, which are Python, take turns).

Ready (``EngineConfig.compile_in_background``): the engine serves once the *ready set*
is compiled, one decode row ``[1, 1]`` and one prefill row ``[1, ready_prefill_chunk]``
(32 columns by default), which between them can run any request; the rest compiles
behind it, on threads of lower CPU priority than the step's. What is compiled is
published as ``BucketLimits``, each limit a bucket whose smaller buckets are compiled
too (prefill chunks: a run of buckets around the ready one), and the scheduler keeps
every call within them: fewer decode rows a step, shorter prefill chunks, one prefill
row, no deferred sampling (a structured-output row then sits out the step after each of
its tokens), a chunk shorter than the shortest compiled one padded to it. So a request
whose bucket is not compiled yet runs at once, split into compiled buckets, rather than
waiting: on a cold start a bucket takes seconds to compile, while a prompt split into
32-token chunks costs a few short steps (and the split is the chunked prefill the engine
does anyway: the same tokens).

Why 32 columns and not the shortest bucket (16): a prefill call has a fixed cost (every
weight is read once) that a short chunk pays per few tokens. SmolLM2 on the 2-core CPU
(the latency profile: 49 ms + 1.74 ms a token) runs a 100-token prompt as seven 16-token
calls in 2.0x the TTFT of its one 128-column call, as four 32-token calls in 1.55x, as
two 64-token calls in 1.2x. Against the same steady state, the worst prompt length is
2.5x with a 16-column ready chunk (long prompts), 1.7x with 32 (long prompts; a prompt
of at most 16 tokens pays 1.36x padding), 2.1x with 64 (a 16-token prompt padded to 64)
and 3.5x with 128: 32 is the ready chunk with the smallest worst case. Where a call's
fixed cost dominates longer chunks (a GPU reading the weights from HBM), a larger
``ready_prefill_chunk`` is the better choice.

A shape nobody compiled ahead (a test calling ``call_step`` on its own shape, a
multi-host follower replaying process 0's calls) falls back to the jitted function,
which compiles it as before; the engine never asks for one while serving.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from superinfer_jax.config import BucketLimits, EngineConfig
from superinfer_jax.runner.executable_cache import ExecutableCache

log = logging.getLogger(__name__)

STEP = "step"
RESAMPLE = "resample"
DUPLEX = "duplex"  # DuplexKV's page gather and scatter, per staging bucket
REFILL = "refill"  # compile for real what XLA's cache served (``ExecutableCache.refill``)
BACKGROUND_NICE = 10  # background compile threads yield the CPU to the serving step
# A background compile starts once the engine has been idle for QUIET_S, or busy for
# BUSY_WAIT_S (a server that never idles still compiles): see BucketCompiler.
QUIET_S = 0.5
BUSY_WAIT_S = 2.0


@dataclass(frozen=True)
class Program:
    """One program to compile: the step at ``shape`` = (rows, columns), deferred
    sampling at ``shape`` = (rows,), or DuplexKV's copies at ``shape`` = (pages,)."""

    kind: str
    shape: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.kind} {'x'.join(map(str, self.shape))}"


class Programs:
    """Ahead-of-time executables of one jitted function, one per shape, called like it.

    ``key(args)`` gives a call's shape; the first ``num_static`` arguments are static
    (the jitted function's ``static_argnums``), part of the key and not passed to the
    executable."""

    def __init__(self, jitted: Any, key: Callable[[tuple], Hashable], num_static: int = 0,
                 cache: ExecutableCache | None = None, name: str = ""):
        self.jitted = jitted
        self._key = key
        self._num_static = num_static
        # serialized executables on disk: a warm start skips tracing and lowering
        self.cache = cache
        self.name = name
        self._executables: dict[Hashable, Any] = {}
        self.num_fallback_calls = 0  # calls on a shape nobody compiled ahead

    @property
    def compiled(self) -> frozenset[Hashable]:
        return frozenset(self._executables)

    def compile(self, *args: Any) -> None:
        """Compile the shape of ``args`` (abstract values will do; nothing runs)."""
        key = self._key(args)
        if key in self._executables:
            return
        if self.cache is None:
            self._executables[key] = self.jitted.lower(*args).compile()
        else:
            self._executables[key] = self.cache.get_or_compile(
                self.name, args, lambda: self.jitted.lower(*args))

    def __call__(self, *args: Any) -> Any:
        executable = self._executables.get(self._key(args))
        if executable is None:
            self.num_fallback_calls += 1
            return self.jitted(*args)
        return executable(*args[self._num_static:])


def ready_set(config: EngineConfig) -> list[Program]:
    """The fewest programs that can run any request: one decode row, one prefill row of
    the ready chunk (``EngineConfig.ready_chunk_bucket``)."""
    return [Program(STEP, (1, 1)), Program(STEP, (1, config.ready_chunk_bucket))]


def compile_order(config: EngineConfig, resample_buckets: Sequence[int],
                  duplex_buckets: Sequence[int] = ()) -> list[Program]:
    """Every program, the ready set first, then DuplexKV's copies (small, and eager
    shadows copy pages from the first requests on), then in the order that lifts the
    limits soonest: longer single-row chunks (a prompt's TTFT) alternating with more
    decode rows (concurrency), deferred sampling, and the packed prefill shapes
    (throughput when several prompts arrive at once)."""
    ready = ready_set(config)
    # the shorter chunks first: they end the padding of short prompts to the ready chunk
    chunks = [Program(STEP, (1, c)) for c in config.prefill_chunk_buckets
              if c != config.ready_chunk_bucket]
    decode = [Program(STEP, (b, 1)) for b in config.decode_buckets[1:]]
    order = list(ready) + [Program(DUPLEX, (b,)) for b in duplex_buckets]
    for i in range(max(len(chunks), len(decode))):
        order += chunks[i:i + 1] + decode[i:i + 1]
    order += [Program(RESAMPLE, (r,)) for r in resample_buckets]
    order += [Program(STEP, s) for s in config.prefill_shapes if s[0] > 1]
    return order


def _compiled_run(buckets: Sequence[int], around: int, done: Callable[[int], bool]
                  ) -> tuple[int, int] | None:
    """The first and last bucket of the run of compiled buckets that holds ``around``
    (None: ``around`` is not compiled)."""
    if not done(around):
        return None
    i = j = buckets.index(around)
    while i > 0 and done(buckets[i - 1]):
        i -= 1
    while j + 1 < len(buckets) and done(buckets[j + 1]):
        j += 1
    return buckets[i], buckets[j]


def _largest_prefix(buckets: Sequence[int], done: Callable[[int], bool]) -> int:
    """The last bucket of the longest run of compiled buckets from the smallest (0: the
    smallest is not compiled)."""
    largest = 0
    for b in buckets:
        if not done(b):
            break
        largest = b
    return largest


def bucket_limits(config: EngineConfig, steps: frozenset[Hashable],
                  resamples: frozenset[Hashable], resample_buckets: Sequence[int],
                  copies: bool = True) -> BucketLimits:
    """What the compiled step shapes ``steps`` and resample row counts ``resamples``
    allow a call, and whether DuplexKV's ``copies`` are ready (see ``BucketLimits``)."""
    decode = _largest_prefix(config.decode_buckets, lambda b: (b, 1) in steps)
    buckets = config.prefill_chunk_buckets
    chunk_done: Callable[[int], bool] = lambda c: (1, c) in steps
    # no ready chunk (a caller compiling its own shapes): the run from the smallest
    shortest, chunk = _compiled_run(buckets, config.ready_chunk_bucket, chunk_done) \
        or _compiled_run(buckets, buckets[0], chunk_done) or (0, 0)
    # packed rows once every packed shape up to the chunk is (the last compiles)
    packed = [s for s in config.prefill_shapes if s[0] > 1 and s[1] <= chunk]
    rows = config.max_prefill_rows if all(s in steps for s in packed) else 1
    deferred = _largest_prefix(resample_buckets, lambda r: (r,) in resamples)
    floor = shortest if chunk and shortest != buckets[0] else 0
    return BucketLimits(decode, rows if chunk else 0, chunk, deferred, copies, floor)


class BucketCompiler:
    """Compiles ``programs`` in order on ``num_threads`` worker threads.

    ``wait_ready`` returns once the first ``num_ready`` programs are compiled; the rest go
    on behind (``done`` is set when all are). Threads that pass the ready set lower
    their CPU priority when ``background``, so that serving steps get the cores first.
    A compile that fails stops the rest; ``error`` holds it and ``wait_ready`` raises it.
    ``on_compiled(program)`` runs on the worker thread after each compile.

    No background compile starts before the ready set is compiled (a thread done with
    its ready program waits), and then background compiles wait for the engine: the
    next one starts once the engine has
    been idle (``set_busy(False)``) for ``quiet_s``, or busy (``set_busy(True)``: requests
    in flight) for ``busy_wait_s``; until the engine first says either (its first runs
    after the ready set), they wait. Nice 10 does not stop a compile from holding the GIL
    while it traces and lowers, and on a 2-core machine the first request after ready
    took 3.5-4.3x the steady-state TTFT when it met two compiles; now a request that
    arrives within ``quiet_s`` of ready, or of the last one, runs on an idle CPU (a
    compile already under way finishes). Under sustained load the compiles go on after
    ``busy_wait_s``, so the limits still grow."""

    def __init__(self, compile_one: Callable[[Program], None], programs: Sequence[Program],
                 num_ready: int, num_threads: int, background: bool,
                 on_compiled: Callable[[Program], None] | None = None,
                 quiet_s: float = QUIET_S, busy_wait_s: float = BUSY_WAIT_S):
        self._compile_one = compile_one
        self._quiet_s, self._busy_wait_s = quiet_s, busy_wait_s
        self._engine = threading.Condition()
        self._idle_since: float | None = None  # the engine's state, since when
        self._busy_since: float | None = None
        self._programs = list(programs)
        self._queue: deque[tuple[int, Program]] = deque(enumerate(programs))
        self._num_ready = num_ready
        self._background = background
        self._on_compiled = on_compiled
        self._lock = threading.Lock()
        self._left = len(programs)
        self._ready_left = min(num_ready, len(programs))
        self.ready = threading.Event()
        self.done = threading.Event()
        self.cancelled = threading.Event()  # ``cancel`` was called
        self.error: BaseException | None = None
        self.seconds: dict[Program, float] = {}  # each compiled program, wall clock
        if self._ready_left == 0:
            self.ready.set()
        if self._left == 0:
            self.done.set()
        self._threads = [threading.Thread(target=self._work, name=f"compile-{i}",
                                          daemon=True) for i in range(num_threads)]
        for t in self._threads:
            t.start()

    def compiled(self, kind: str) -> bool:
        """Whether every program of ``kind`` is compiled (none left to compile)."""
        with self._lock:
            return not any(p.kind == kind for _, p in self._queue) and all(
                p in self.seconds for p in self._programs if p.kind == kind)

    @property
    def num_left(self) -> int:
        with self._lock:
            return self._left

    def wait_ready(self) -> None:
        self.ready.wait()
        if self.error is not None:
            raise self.error

    def wait_done(self, timeout: float | None = None) -> bool:
        """Block until every program is compiled (or one failed); False on timeout."""
        finished = self.done.wait(timeout)
        if self.error is not None:
            raise self.error
        return finished

    def set_busy(self, busy: bool) -> None:
        """Whether the engine has requests in flight (see the class docstring)."""
        with self._engine:
            now = time.monotonic()
            if busy and self._busy_since is None:
                self._busy_since, self._idle_since = now, None
            elif not busy and self._idle_since is None:
                self._idle_since, self._busy_since = now, None
            self._engine.notify_all()

    def _wait_for_engine(self) -> None:
        """Block until a background compile may start (see the class docstring)."""
        with self._engine:
            while self._queue:  # empty: cancelled or done, nothing to wait for
                now = time.monotonic()
                if self._idle_since is not None:
                    left = self._idle_since + self._quiet_s - now
                elif self._busy_since is not None:
                    left = self._busy_since + self._busy_wait_s - now
                else:
                    left = self._quiet_s  # the engine has not said yet: look again then
                if left <= 0 and (self._idle_since is not None or self._busy_since is not None):
                    return
                self._engine.wait(max(left, 0.01))

    def cancel(self, wait_s: float = 0.0) -> bool:
        """Compile nothing more; a compile under way finishes. With ``wait_s``, wait up to
        that long for it: a process must not exit while a thread is inside XLA's compiler
        (the interpreter's exit tears down what it uses, and the process aborts with
        "terminate called ..." instead of its exit code). Returns whether every compile
        thread has ended."""
        self.cancelled.set()
        with self._lock:
            self._queue.clear()
        with self._engine:
            self._engine.notify_all()
        deadline = time.monotonic() + wait_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def _work(self) -> None:
        niced = False
        while True:
            if self._background:
                with self._lock:  # next is past the ready set: the ready set first
                    past_ready = bool(self._queue) and self._queue[0][0] >= self._num_ready
                if past_ready or self.ready.is_set():
                    # A thread done with its ready program waits for the others: on a
                    # cold start a background compile beside the last ready one took
                    # CPU from it (on 2 shared cores, [1, 16] finished after duplex 1).
                    self.ready.wait()
                    self._wait_for_engine()
            with self._lock:
                if not self._queue:
                    return
                index, program = self._queue.popleft()
            if self._background and index >= self._num_ready and not niced:
                niced = _lower_priority()
            t0 = time.perf_counter()
            try:
                self._compile_one(program)
                if self._on_compiled is not None:
                    self._on_compiled(program)
            except BaseException as e:  # the engine raises it (wait_ready, or its step)
                log.exception("compiling %s failed", program)
                with self._lock:
                    self.error = self.error or e
                    self._queue.clear()
                self.ready.set()
                self.done.set()
                return
            with self._lock:
                self.seconds[program] = time.perf_counter() - t0
                self._left -= 1
                if index < self._num_ready:
                    self._ready_left -= 1
                    if self._ready_left == 0:
                        self.ready.set()
                if self._left == 0:
                    self.done.set()


def _lower_priority() -> bool:
    """Raise this thread's nice value (Linux: niceness is per thread), so that compiles
    started from it (and the threads they start) yield to the serving step."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except (AttributeError, OSError):  # not Linux, or not allowed: compile at full priority
        return False
    return True


def default_num_threads() -> int:
    """Compile threads: one per core, at most 4 (each compile holds its own memory)."""
    return max(1, min(4, os.cpu_count() or 1))
