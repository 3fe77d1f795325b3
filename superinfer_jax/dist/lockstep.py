"""Multi-controller discipline: every process makes the same device calls in the same order.

JAX across hosts is multi-controller: a program that spans the mesh runs only when every
process has dispatched it, with the same numpy inputs, in the same order. Process 0 owns
the servers, the scheduler and the page bookkeeping; the others decide nothing and replay
process 0's *device calls*. Every call the model runner makes on the device goes through
one of six entry points (the step, the deferred resample, committing a constant, and the
page mover's ``to_host``, ``to_device``, ``scatter``, plus its warm-up). On process 0 a
``Recorder`` wraps them and appends each call to the tape: numpy arrays and ints as they
are, every ``jax.Array`` as a handle (the call that produced it, its leaf index). Each
follower (``run_follower``) builds the same ``ModelRunner`` and makes the same calls on
its own shards.

Why this cannot diverge:
- A follower runs nothing it was not sent, in the order sent, and reads no device value:
  nothing on it could decide differently.
- Process 0 records and executes each call under one lock: the tape's order is its own.
- Numpy inputs are process 0's bytes; a handle is only produced by a call both sides made.
- Decisions that read the device (has a page copy arrived) stay on process 0; a
  follower's scatter waits on its own copy by data dependency, and a copy that fails
  there fails its step, and so the group.
- A call that raises on process 0 after it was sent is followed by a ``forget``.

The channel is the coordination service's key-value store, not a device broadcast (itself
a cross-process program that would need ordering against the steps): host-side, with a
timeout on every read. Calls without collectives are buffered and sent with the next
step. Process 0 holds a weak reference to every handled array; when one is collected,
the next message tells the followers to drop theirs.
"""
from __future__ import annotations

import logging
import pickle
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax

from superinfer_jax.dist.distributed import Group, GroupError
from superinfer_jax.runner.model_runner import ModelRunner

log = logging.getLogger(__name__)

# Calls whose program spans processes (the step's collectives; committing a value to the
# mesh): sent before they run.
COLLECTIVE_CALLS = frozenset({"step", "resample", "mover_warmup", "commit"})
POLL_S = 1.0  # a follower's wait for the next message, in slices of this


@dataclass(frozen=True)
class Handle:
    """A device array both sides created: the ``call``-th call's ``leaf``-th output
    (call -1: made while the runner was built)."""

    call: int
    leaf: int


@dataclass
class Call:
    """One device call on the tape."""

    index: int
    name: str
    args: tuple  # numpy / ints / Handles in the call's pytree structure
    release: list[Handle]  # arrays process 0 has dropped since the previous call


@dataclass
class Forget:
    """A call that failed on process 0: its outputs on the followers are never named."""

    index: int


def _init_arrays(runner: ModelRunner) -> list[jax.Array]:
    """Arrays the runner made while it was built (identical on every process)."""
    return [runner.no_tokens, runner.kv_pool]


class Recorder:
    """Process 0's side: wraps the runner's device calls, sends them before running them."""

    def __init__(self, runner: ModelRunner, group: Group):
        self.runner = runner
        self.group = group
        self.sent = 0  # messages sent (the watchdog compares followers' progress to it)
        self.bytes_sent = 0  # their payload, once per follower
        self._lock = threading.RLock()
        self._depth = 0  # > 0 inside a recorded call: nested device calls are its own
        self._next = 0
        self._pending: list[Call | Forget] = []
        self._handles: dict[int, Handle] = {}  # id(array) -> handle
        self._released: list[Handle] = []
        for k, array in enumerate(_init_arrays(runner)):
            self._register(array, Handle(-1, k))
        self._wrap_runner()


    def _wrap_runner(self) -> None:
        runner = self.runner
        step_fn, params = runner._step_fn, runner.step_params

        def step(param_leaves, *args):
            if param_leaves is not params:
                raise GroupError("the step was called with other weights than the runner's")
            return self.call("step", lambda *a: step_fn(params, *a), args)

        runner._step_fn = step
        runner._resample_fn = self._wrapped("resample", runner._resample_fn)
        runner.committed = self._wrapped("commit", runner.committed)  # type: ignore[method-assign]
        if runner.duplex is not None:
            mover = runner.duplex.mover
            for name in ("to_host", "to_device", "scatter"):
                setattr(mover, name, self._wrapped(name, getattr(mover, name)))
            mover.warmup = self._wrapped("mover_warmup", mover.warmup)  # type: ignore[method-assign]

    def _wrapped(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args):
            return self.call(name, fn, args)

        return wrapper

    def call(self, name: str, fn: Callable[..., Any], args: tuple) -> Any:
        """Put ``name(*args)`` on the tape (sending it first when it spans processes),
        then run it here and hand its outputs handles."""
        with self._lock:
            if self._depth:  # e.g. mover.warmup's own copies: replayed as part of it
                return fn(*args)
            index = self._next
            self._next += 1
            release, self._released = self._released, []
            self._pending.append(Call(index, name, jax.tree.map(self._encode, args), release))
            if name in COLLECTIVE_CALLS:
                self.flush()
            self._depth += 1
            try:
                out = fn(*args)
            except BaseException:
                self._pending.append(Forget(index))
                raise
            finally:
                self._depth -= 1
            for leaf, array in enumerate(jax.tree.leaves(out)):
                if isinstance(array, jax.Array):
                    self._register(array, Handle(index, leaf))
            return out

    def flush(self) -> None:
        """Send the buffered calls to every follower, as one message."""
        with self._lock:
            if not self._pending:
                return
            payload = pickle.dumps(self._pending, protocol=pickle.HIGHEST_PROTOCOL)
            self._pending = []
            self.sent += 1
            self.bytes_sent += len(payload)
            for p in range(1, self.group.num_processes):
                self.group.put(self.group.key("tape", p, self.sent), payload)

    def stop(self) -> None:
        """Tell the followers to exit 0 (after everything sent so far); the watchdog
        stops first, since they stop answering once they have read it."""
        self.group.end()
        with self._lock:
            self._pending.append(Call(self._next, "stop", (), []))
            self.flush()


    def _encode(self, leaf: Any) -> Any:
        if not isinstance(leaf, jax.Array):
            return leaf
        handle = self._handles.get(id(leaf))
        if handle is None:
            raise GroupError("a device call got an array no recorded call made (a new "
                             "device entry point the lockstep recorder does not wrap?)")
        return handle

    def _register(self, array: jax.Array, handle: Handle) -> None:
        key = id(array)
        self._handles[key] = handle
        weakref.finalize(array, self._forget, key, handle)

    def _forget(self, key: int, handle: Handle) -> None:
        # Runs when process 0's array is collected, possibly inside ``call``: lock-free.
        if self._handles.get(key) == handle:
            del self._handles[key]
        self._released.append(handle)


class Replayer:
    """A follower's side: the same calls on the same runner, arrays looked up by handle."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.arrays: dict[Handle, Any] = {
            Handle(-1, k): a for k, a in enumerate(_init_arrays(runner))}
        params = runner.step_params
        step_fn = runner._step_fn
        self.fns: dict[str, Callable[..., Any]] = {
            "step": lambda *a: step_fn(params, *a),
            "resample": runner._resample_fn,
            "commit": runner.committed,
        }
        if runner.duplex is not None:
            mover = runner.duplex.mover
            self.fns.update(to_host=mover.to_host, to_device=mover.to_device,
                            scatter=mover.scatter, mover_warmup=mover.warmup)

    def run(self, item: Call | Forget) -> bool:
        """Replay one tape item; False once told to stop."""
        if isinstance(item, Forget):
            for h in [h for h in self.arrays if h.call == item.index]:
                del self.arrays[h]
            return True
        for h in item.release:
            self.arrays.pop(h, None)
        if item.name == "stop":
            return False
        args = jax.tree.map(self._decode, item.args,
                            is_leaf=lambda x: isinstance(x, Handle))
        out = self.fns[item.name](*args)
        for leaf, array in enumerate(jax.tree.leaves(out)):
            if isinstance(array, jax.Array):
                self.arrays[Handle(item.index, leaf)] = array
        return True

    def _decode(self, leaf: Any) -> Any:
        if isinstance(leaf, Handle):
            try:
                return self.arrays[leaf]
            except KeyError:
                raise GroupError(f"process 0 named an array this process does not hold "
                                 f"({leaf}): the tapes diverged") from None
        return leaf


def run_follower(runner: ModelRunner, group: Group,
                 ready: Callable[[], object] | None = None) -> None:
    """A follower's life after start-up: replay process 0's messages until told to stop.
    A read that fails other than "not yet" means process 0 is gone (``GroupError``).
    ``ready`` blocks until the runner may replay; the heartbeat beats meanwhile."""
    replayer = Replayer(runner)
    done = 0
    group.start_heartbeat(lambda: done)
    if ready is not None:
        ready()
    while True:
        key = group.key("tape", group.process_id, done + 1)
        payload = _next_message(group, key)
        group.delete(key)
        items: list[Call | Forget] = pickle.loads(payload)
        for item in items:
            if not replayer.run(item):
                log.info("process 0 stopped the group after %d messages", done + 1)
                return
        done += 1


def _next_message(group: Group, key: str) -> bytes:
    while True:
        try:
            return bytes(group.client.blocking_key_value_get_bytes(key, int(POLL_S * 1000)))
        except Exception as e:  # noqa: BLE001 - status codes arrive as message text
            if "DEADLINE_EXCEEDED" in str(e):
                continue  # process 0 is idle
            raise GroupError(f"process {group.process_id}: lost process 0 (the "
                             f"coordinator {group.config.coordinator}): "
                             f"{str(e).strip().splitlines()[0] if str(e).strip() else e!r}"
                             ) from None
