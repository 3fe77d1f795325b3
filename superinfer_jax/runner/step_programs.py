"""Start-up compilation: each call shape compiled ahead of time, smallest first, on
several threads, so that a serving step never compiles.

``Programs`` holds one ahead-of-time executable per shape bucket and is called like the
jitted function it wraps; ``BucketCompiler`` compiles a priority-ordered list on worker
threads (XLA's compiler releases the GIL). With ``compile_in_background`` the engine
serves once the *ready set* (one decode row, one prefill row of ``ready_prefill_chunk``
columns) is compiled, and the scheduler keeps every call within the published
``BucketLimits`` while the rest compiles behind: a request whose bucket is not compiled
yet runs at once, split into compiled chunks, instead of waiting seconds for a compile.
The ready chunk defaults to 32 columns, the one with the smallest worst-case TTFT on a
CPU (``docs/results/runner.md``); where a call's fixed cost dominates (a GPU), a larger
chunk is better. A shape nobody compiled ahead falls back to the jitted function.
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
# a background compile starts after the engine idled QUIET_S or was busy BUSY_WAIT_S
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
    (part of the key, not passed to the executable)."""

    def __init__(self, jitted: Any, key: Callable[[tuple], Hashable], num_static: int = 0,
                 cache: ExecutableCache | None = None, name: str = ""):
        self.jitted = jitted
        self._key = key
        self._num_static = num_static
        self.cache = cache  # serialized executables on disk
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
    """Every program, the ready set first, then DuplexKV's copies (eager shadows copy
    from the first requests on), then what lifts the limits soonest: single-row chunks
    alternating with more decode rows, deferred sampling, and packed prefill shapes."""
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
    rows = config.engine.max_prefill_rows if all(s in steps for s in packed) else 1
    deferred = _largest_prefix(resample_buckets, lambda r: (r,) in resamples)
    floor = shortest if chunk and shortest != buckets[0] else 0
    return BucketLimits(decode, rows if chunk else 0, chunk, deferred, copies, floor)


class BucketCompiler:
    """Compiles ``programs`` in order on ``num_threads`` worker threads.

    ``wait_ready`` returns once the first ``num_ready`` are compiled; the rest go on behind
    (``done`` when all are), at lower CPU priority when ``background``, each starting once
    the engine has been idle for ``quiet_s`` or busy for ``busy_wait_s`` (a compile holds
    the GIL while it traces, whatever its nice value). A failed compile stops the rest
    (``error``, raised by the waits). ``on_compiled(program)`` runs after each compile."""

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
        that long for it (a process that exits while a thread is inside XLA's compiler
        aborts). Returns whether every compile thread has ended."""
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
                    # the ready set first: a background compile beside the last ready
                    # one would take CPU from it
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
