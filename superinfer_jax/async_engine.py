"""A thread-safe front for ``LLMEngine``: one engine thread steps, servers only enqueue.

``LLMEngine`` is single-threaded by design (one deterministic loop owns the KV pool and
the scheduler); servers talk to it through commands, in this order:

1. ``submit(...)`` gives the request an id and a ``RequestStream``, queues an add and
   returns at once; ``stream.admitted`` resolves on the engine thread (``None``, or the
   refusal), so validation stays the engine's.
2. Between steps the engine thread drains the commands in arrival order (adds, aborts).
3. It steps while work exists and routes every ``RequestOutput`` to its stream; a
   finished request is released from the engine at once.
4. Observers (metrics) see each step's outputs and a stats snapshot on this thread.
5. With no work it waits on a condition variable, after the engine's deferred warm-up
   (``LLMEngine.idle_work``), a piece at a time, between commands.

Every stream gets a final item (finished, aborted, or the engine's failure), so a
consumer may block on it without a timeout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from superinfer_jax.engine import LLMEngine, RequestOutput
from superinfer_jax.request import SLO, SamplingParams, check_cache_salt

log = logging.getLogger(__name__)

Observer = Callable[[list[RequestOutput], dict[str, Any]], None]
WARMUP_POLL_S = 0.25  # an idle loop looks this often for deferred warm-up that is due


class QueueFullError(Exception):
    """The admission queue holds ``max_queue_len`` waiting requests already."""


class DuplicateRequestError(ValueError):
    """A request with this id is in flight already."""


class EngineUnavailableError(Exception):
    """The engine is draining, stopped, or failed; nothing new is admitted."""


class EngineState(enum.Enum):
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"


class RequestStream:
    """Outputs of one request, pushed by the engine thread, read by one consumer: a
    coroutine on ``loop`` (``async for``), else a thread (``for``). The last item has
    ``finished`` set; an engine failure is raised from the iterator instead."""

    def __init__(self, req_id: str, loop: asyncio.AbstractEventLoop | None = None):
        self.req_id = req_id
        self.admitted: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._loop = loop
        self._queue: queue.SimpleQueue[RequestOutput | BaseException] = queue.SimpleQueue()
        self._aqueue: asyncio.Queue[RequestOutput | BaseException] | None = (
            asyncio.Queue() if loop is not None else None
        )

    def put(self, item: RequestOutput | BaseException) -> None:
        """Engine thread only."""
        if self._loop is None:
            self._queue.put(item)
            return
        assert self._aqueue is not None  # created with the loop
        try:
            self._loop.call_soon_threadsafe(self._aqueue.put_nowait, item)
        except RuntimeError:
            pass  # the consumer's loop is closed: nobody is listening any more

    def wait_admitted(self, timeout: float | None = None) -> None:
        """Block until the engine thread added the request; raises its refusal."""
        self.admitted.result(timeout)

    async def wait_admitted_async(self) -> None:
        await asyncio.wrap_future(self.admitted)

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            item = self._queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        assert self._aqueue is not None, "submit(..., loop=...) for async iteration"
        while True:
            item = await self._aqueue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return


@dataclass
class _Add:
    stream: RequestStream
    prompt_token_ids: list[int]
    sampling: SamplingParams
    slo: SLO | None
    arrival_time: float
    cache_salt: str | None = None
    fork_of: str | None = None


@dataclass
class _Abort:
    req_id: str


class AsyncEngine:
    """Owns an ``LLMEngine`` and the one thread that steps it."""

    def __init__(self, engine: LLMEngine, max_queue_len: int = 256,
                 observers: list[Observer] | None = None):
        if isinstance(max_queue_len, bool) or not isinstance(max_queue_len, int) \
                or max_queue_len < 1:
            raise ValueError(f"max_queue_len must be a positive int, got {max_queue_len!r}")
        self.engine = engine
        self.max_queue_len = max_queue_len
        self.observers = list(observers or [])
        self.state = EngineState.SERVING
        self.failure: BaseException | None = None
        self._cond = threading.Condition()
        self._commands: list[_Add | _Abort] = []
        self._streams: dict[str, RequestStream] = {}  # admitted or pending, not finished
        self._num_admitted = 0
        self._stop = False
        self._stats: dict[str, Any] = self._snapshot()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()


    def submit(self, prompt_token_ids: list[int], sampling: SamplingParams, *,
               req_id: str | None = None, slo: SLO | None = None,
               loop: asyncio.AbstractEventLoop | None = None,
               cache_salt: str | None = None, fork_of: str | None = None) -> RequestStream:
        """Queue a request; returns its stream at once (see ``stream.admitted``).
        ``cache_salt`` is checked here, so a bad one fails the caller, not the loop;
        ``fork_of``: as ``LLMEngine.add_request``."""
        check_cache_salt(cache_salt)
        arrival = time.perf_counter()
        req_id = req_id or uuid.uuid4().hex
        with self._cond:
            if self.state is not EngineState.SERVING:
                raise EngineUnavailableError(self._unavailable_reason())
            if req_id in self._streams:
                raise DuplicateRequestError(f"request_id {req_id!r} is already in flight")
            if len(self._commands) >= self.max_queue_len:
                raise QueueFullError(
                    f"admission queue is full ({self.max_queue_len} requests pending)")
            stream = RequestStream(req_id, loop)
            self._streams[req_id] = stream
            self._commands.append(_Add(stream, list(prompt_token_ids), sampling, slo, arrival,
                                       cache_salt, fork_of))
            self._cond.notify()
        return stream

    def abort(self, req_id: str) -> bool:
        """Abort a request; False when it is unknown or already finished."""
        with self._cond:
            if req_id not in self._streams:
                return False
            self._commands.append(_Abort(req_id))
            self._cond.notify()
        return True

    def stats(self) -> dict[str, Any]:
        """The engine's stats as of the last step, plus the loop's own counters."""
        with self._cond:
            return dict(self._stats)

    @property
    def num_in_flight(self) -> int:
        with self._cond:
            return len(self._streams)

    def drain(self, grace_s: float) -> bool:
        """Stop admitting, let in-flight requests finish for up to ``grace_s`` seconds,
        abort the rest, stop the thread. True when nothing had to be aborted."""
        deadline = time.monotonic() + grace_s
        with self._cond:
            if self.state is EngineState.SERVING:
                self.state = EngineState.DRAINING
            while self._streams and self.failure is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.5))
            clean = not self._streams
        self.stop()
        return clean

    def stop(self) -> None:
        """Abort everything still in flight and stop the engine thread."""
        with self._cond:
            self.state = EngineState.STOPPED
            self._stop = True
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join()


    def _has_work(self) -> bool:
        return bool(self._commands or self._stop or self.engine.has_unfinished_requests())

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._has_work() and not self._warmup_pending():
                    self._cond.wait()
                commands, self._commands = self._commands, []
                stopping = self._stop
            try:
                if not (commands or stopping or self.engine.has_unfinished_requests()):
                    self._warm_up_while_idle()
                    continue
                outputs = [out for cmd in commands if (out := self._apply(cmd)) is not None]
                if stopping:
                    outputs += self._abort_all()
                elif self.engine.has_unfinished_requests():
                    outputs += self.engine.step()
                self._route(outputs)
                self._publish(outputs)
            except Exception as e:  # the pool or the bookkeeping may be gone: fail loudly
                log.exception("engine loop failed; failing all requests")
                self._fail_all(e)
                return
            if stopping:
                return

    def _warmup_pending(self) -> bool:
        # an engine without deferred warm-up (a test's fake) has none pending
        return bool(getattr(self.engine, "warmup_pending", False))

    def _warm_up_while_idle(self) -> None:
        """A piece of the engine's deferred warm-up; when none is due yet (compiles still
        running), wait a little for one, or for a command."""
        if self.engine.idle_work():
            return
        with self._cond:
            if not self._has_work():
                self._cond.wait(WARMUP_POLL_S)

    def _apply(self, cmd: _Add | _Abort) -> RequestOutput | None:
        if isinstance(cmd, _Abort):
            return self._abort_one(cmd.req_id)
        stream = cmd.stream
        try:
            if self.state is EngineState.STOPPED:
                raise EngineUnavailableError(self._unavailable_reason())
            if self.engine.stats().get("num_waiting", 0) >= self.max_queue_len:
                raise QueueFullError(
                    f"admission queue is full ({self.max_queue_len} requests waiting)")
            self.engine.add_request(cmd.prompt_token_ids, cmd.sampling, req_id=stream.req_id,
                                    slo=cmd.slo, arrival_time=cmd.arrival_time,
                                    cache_salt=cmd.cache_salt, fork_of=cmd.fork_of)
        except Exception as e:
            with self._cond:
                self._streams.pop(stream.req_id, None)
            stream.admitted.set_exception(e)
            return None
        self._num_admitted += 1
        stream.admitted.set_result(None)
        return None

    def _abort_one(self, req_id: str) -> RequestOutput | None:
        if not self.engine.abort_request(req_id):
            return None  # finished in the meantime, or refused before admission
        req = self.engine.requests[req_id]
        return RequestOutput(req_id, [], "", True, req.status.finish_reason, req)

    def _abort_all(self) -> list[RequestOutput]:
        with self._cond:
            ids = list(self._streams)
        return [out for i in ids if (out := self._abort_one(i)) is not None]

    def _route(self, outputs: list[RequestOutput]) -> None:
        finished = []
        for out in outputs:
            stream = self._streams.get(out.req_id)
            if out.finished:
                self.engine.release(out.req_id)
                finished.append(out.req_id)
            if stream is not None:
                stream.put(out)
        if finished:
            with self._cond:
                for req_id in finished:
                    self._streams.pop(req_id, None)
                self._cond.notify_all()  # drain() waits for the streams to empty

    def _publish(self, outputs: list[RequestOutput]) -> None:
        stats = self._snapshot()
        with self._cond:
            self._stats = stats
        for observer in self.observers:
            try:
                observer(outputs, stats)
            except Exception:  # metrics must never take the engine down
                log.exception("engine observer %r failed", observer)

    def _snapshot(self) -> dict[str, Any]:
        stats = dict(self.engine.stats())
        stats["num_requests_total"] = self._num_admitted
        return stats

    def _fail_all(self, error: Exception) -> None:
        failure = EngineUnavailableError(f"engine failed: {type(error).__name__}: {error}")
        with self._cond:
            self.failure = failure
            self.state = EngineState.STOPPED
            streams, self._streams = list(self._streams.values()), {}
            self._cond.notify_all()
        for stream in streams:
            if not stream.admitted.done():
                stream.admitted.set_exception(failure)
            stream.put(failure)

    def _unavailable_reason(self) -> str:
        if self.failure is not None:
            return str(self.failure)
        if self.state is EngineState.DRAINING:
            return "server is draining: not admitting new requests"
        return "engine is stopped"
