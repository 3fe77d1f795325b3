"""Joining a multi-host process group: ``jax.distributed`` with bounded waits and clear errors.

One engine process per host, each started with the same configuration plus where the
group meets (``--coordinator HOST:PORT --num-processes N --process-id I``, or JAX's own
``JAX_*`` variables). Process 0 hosts JAX's coordination service; once every process has
connected, ``parallel.make_mesh`` builds one global mesh. What this module adds:

- *Bad input fails fast, naming the flag*: a bad id or coordinator is refused before
  anything connects; an unreachable coordinator or a missing process ends within
  ``init_timeout_s`` with one message saying which flag to check, never a hang.
- *Same configuration everywhere* (``Group.check_same_config``), naming each differing key.
- *A process that dies takes the group down*: followers write a heartbeat into the
  coordination service's key-value store, and process 0's watchdog turns a silent or
  stuck follower into one clear error and exit status 1 (JAX's own, slower heartbeat
  timeout stays the backstop). A follower that loses process 0 exits 1 at its next read.

The key-value store is also ``lockstep``'s channel.
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

KEY_PREFIX = "superinfer"
CPU_COLLECTIVES = ("gloo", "mpi")
EXIT_GROUP_FAILED = 1  # as an engine failure: a supervisor restarts the group


class GroupError(RuntimeError):
    """The process group could not form, or broke: what happened and what to check."""


class ConfigMismatchError(ValueError):
    """Processes of one group were started with different configurations."""

    def __init__(self, diffs: list[tuple[str, Any, Any]], process_id: int):
        self.keys = [key for key, _, _ in diffs]
        self.process_id = process_id
        parts = [f"{key}: process 0 has {a!r}, process {process_id} has {b!r}"
                 for key, a, b in diffs]
        super().__init__(f"process {process_id} was started with a different configuration "
                         f"than process 0 (every process needs the same): " + "; ".join(parts))


def _parse_coordinator(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"coordinator: expected HOST:PORT (e.g. 10.0.0.1:8476), got "
                         f"{address!r}")
    return host, int(port)


@dataclass(frozen=True)
class DistributedConfig:
    """Where a process group meets and how long anyone waits for anyone."""

    coordinator: str  # HOST:PORT of process 0 (its coordination service binds that port)
    num_processes: int  # processes in the group, process 0 included
    process_id: int  # this process, 0 .. num_processes-1; 0 serves and schedules
    init_timeout_s: int = 60  # to connect to the coordinator and see every process
    liveness_timeout_s: float = 10.0  # a follower silent this long is dead
    step_timeout_s: float = 120.0  # a follower that runs no device call this long is stuck
    cpu_collectives: str = "gloo"  # XLA:CPU's cross-process collectives

    def __post_init__(self) -> None:
        _parse_coordinator(self.coordinator)
        for name in ("num_processes", "process_id", "init_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}: must be an integer, got {value!r}")
        if self.num_processes < 1:
            raise ValueError(f"num_processes: must be >= 1, got {self.num_processes}")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id: must be in [0, {self.num_processes - 1}] for "
                             f"num_processes {self.num_processes}, got {self.process_id}")
        for name in ("init_timeout_s", "liveness_timeout_s", "step_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.cpu_collectives not in CPU_COLLECTIVES:
            raise ValueError(f"cpu_collectives: must be one of {CPU_COLLECTIVES}, got "
                             f"{self.cpu_collectives!r}")

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0

    @classmethod
    def from_env(cls, env: Mapping[str, str], **overrides: Any) -> DistributedConfig | None:
        """From JAX's variables (``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``,
        ``JAX_PROCESS_ID``), each overridable; None when no coordinator is named at all."""
        values: dict[str, Any] = {
            "coordinator": env.get("JAX_COORDINATOR_ADDRESS"),
            "num_processes": env.get("JAX_NUM_PROCESSES"),
            "process_id": env.get("JAX_PROCESS_ID"),
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        if values["coordinator"] is None:
            return None
        for name in ("num_processes", "process_id"):
            raw = values[name]
            if raw is None:
                raise ValueError(f"{name}: required with a coordinator (flag "
                                 f"--{name.replace('_', '-')} or JAX_{name.upper()})")
            try:
                values[name] = int(raw)
            except (TypeError, ValueError):
                raise ValueError(f"{name}: must be an integer, got {raw!r}") from None
        return cls(**values)


def flatten_config(value: Any, prefix: str = "") -> dict[str, Any]:
    """``{"engine.max_num_seqs": 8, ...}`` of nested dataclasses and mappings, leaves
    as JSON values (what ``check_same_config`` compares)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(flatten_config(item, f"{prefix}{key}."))
        return out
    if isinstance(value, tuple):
        value = list(value)
    try:
        json.dumps(value)
    except TypeError:
        value = repr(value)
    return {prefix.rstrip("."): value}


def _jax_backend_started() -> bool:
    from jax._src import xla_bridge

    return bool(getattr(xla_bridge, "_backends", None))


def initialize(config: DistributedConfig) -> Group:
    """Join the group (``jax.distributed.initialize``) within ``init_timeout_s``. Call it
    before any other JAX call: the backend must learn about the other processes."""
    import jax

    if _jax_backend_started():
        raise GroupError("initialize must run before anything else uses JAX (a device "
                         "was already created in this process)")
    jax.config.update("jax_cpu_collectives_implementation", config.cpu_collectives)
    # JAX's preemption service installs a SIGTERM handler of its own (its notifier only
    # records the signal for sync points we never reach), replacing the server's drain.
    jax.config.update("jax_enable_preemption_service", False)
    t0 = time.monotonic()
    if not config.is_leader:
        _wait_reachable(config, t0)
    # JAX's client aborts from C++ when registration times out: say why first
    formed = threading.Event()
    threading.Thread(target=_init_deadline, args=(config, formed), daemon=True).start()
    # Ours fire first (the watchdog below); JAX's abort stays as the backstop.
    heartbeat = int(max(10, 3 * config.liveness_timeout_s))
    try:
        jax.distributed.initialize(config.coordinator, config.num_processes,
                                   config.process_id,
                                   initialization_timeout=config.init_timeout_s,
                                   heartbeat_timeout_seconds=heartbeat,
                                   shutdown_timeout_seconds=max(5, config.init_timeout_s))
    except Exception as e:  # noqa: BLE001 - JAX's errors are RPC statuses: say what to check
        raise GroupError(_not_formed(config, time.monotonic() - t0, _first_line(e))) from None
    finally:
        formed.set()
    from jax._src import distributed as jax_distributed

    client = jax_distributed.global_state.client
    assert client is not None
    return Group(config, client)


def _not_formed(config: DistributedConfig, waited: float, why: str) -> str:
    return (f"could not form the process group at {config.coordinator} as process "
            f"{config.process_id} of {config.num_processes} within {waited:.0f} s "
            f"(init_timeout_s={config.init_timeout_s}): {why}. Check that process 0 is "
            "running with the same --coordinator (reachable from here), that every process "
            "has the same --num-processes, and that each --process-id is unique in "
            "[0, num_processes)")


def _wait_reachable(config: DistributedConfig, t0: float) -> None:
    """A follower: wait (up to the init timeout) until the coordinator accepts TCP
    connections; process 0 may still be starting."""
    host, port = _parse_coordinator(config.coordinator)
    host = host.strip("[]")
    while True:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return
        except OSError as e:
            waited = time.monotonic() - t0
            if waited >= config.init_timeout_s:
                raise GroupError(_not_formed(config, waited, f"the coordinator is "
                                             f"unreachable ({e})")) from None
            time.sleep(0.25)


def _init_deadline(config: DistributedConfig, formed: threading.Event) -> None:
    if formed.wait(max(0.5, config.init_timeout_s - 0.5)):
        return
    _exit_group(_not_formed(config, config.init_timeout_s,
                            "not every process registered with the coordinator"))


class Group:
    """This process's view of its group: the coordination service's key-value store,
    with a timeout on every read."""

    def __init__(self, config: DistributedConfig, client: Any):
        self.config = config
        self.client = client
        self.process_id = config.process_id
        self.num_processes = config.num_processes
        self._ended = threading.Event()

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0

    def key(self, *parts: object) -> str:
        return "/".join([KEY_PREFIX, *map(str, parts)])

    def put(self, key: str, value: bytes) -> None:
        self.client.key_value_set_bytes(key, value, allow_overwrite=True)

    def get(self, key: str, timeout_s: float, waiting_for: str) -> bytes:
        """The value at ``key`` once someone sets it; ``GroupError`` naming what was
        awaited when nobody does within ``timeout_s`` or the coordinator is gone."""
        try:
            return bytes(self.client.blocking_key_value_get_bytes(key, int(timeout_s * 1000)))
        except Exception as e:  # noqa: BLE001 - DEADLINE_EXCEEDED or UNAVAILABLE
            raise GroupError(f"process {self.process_id}: gave up waiting for {waiting_for} "
                             f"after {timeout_s:.0f} s: {_first_line(e)}") from None

    def try_get(self, key: str) -> bytes | None:
        try:
            return bytes(self.client.key_value_try_get_bytes(key))
        except Exception:  # noqa: BLE001 - NOT_FOUND
            return None

    def delete(self, key: str) -> None:
        self.client.key_value_delete(key)

    def check_membership(self) -> None:
        """Every process sees ``num_processes`` processes and this one's id among them
        (JAX takes process 0's count; another count given here is a wrong flag)."""
        import jax

        if jax.process_count() != self.num_processes:
            raise GroupError(f"num_processes: this process was started with "
                             f"{self.num_processes}, but the group at "
                             f"{self.config.coordinator} has {jax.process_count()}")

    def check_same_config(self, flat: Mapping[str, Any]) -> None:
        """Refuse the group unless every process has ``flat`` (and ``num_processes``)
        equal to process 0's: process 0 compares and publishes one verdict, so all of
        them stop (or go on) together."""
        mine = dict(flat, num_processes=self.num_processes)
        self.put(self.key("config", self.process_id), json.dumps(mine).encode())
        timeout = float(self.config.init_timeout_s)
        if self.is_leader:
            verdict: dict[str, Any] = {"ok": True}
            for p in range(1, self.num_processes):
                theirs = json.loads(self.get(self.key("config", p), timeout,
                                             f"process {p}'s configuration"))
                diffs = [(k, mine.get(k), theirs.get(k))
                         for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]
                if diffs:
                    verdict = {"ok": False, "process": p, "diffs": diffs}
                    break
            self.put(self.key("config", "verdict"), json.dumps(verdict).encode())
        else:
            verdict = json.loads(self.get(self.key("config", "verdict"), timeout,
                                          "process 0's configuration check"))
        if not verdict["ok"]:
            raise ConfigMismatchError([tuple(d) for d in verdict["diffs"]], verdict["process"])
        self.check_membership()


    def end(self) -> None:
        """Process 0 is ending the group on purpose: its watchdog stops, so followers
        that exit once told to stop are not taken for dead."""
        self._ended.set()

    def beat_key(self, process_id: int) -> str:
        return self.key("beat", process_id)

    def start_heartbeat(self, progress: Callable[[], int]) -> threading.Thread:
        """Follower: every quarter of the liveness timeout, publish a counter and
        ``progress()`` (the last device-call message it ran)."""
        period = self.config.liveness_timeout_s / 4

        def beat() -> None:
            n = 0
            while True:
                n += 1
                try:
                    self.put(self.beat_key(self.process_id), f"{n}:{progress()}".encode())
                except Exception:  # noqa: BLE001 - process 0 is gone: the main loop says so
                    return
                time.sleep(period)

        thread = threading.Thread(target=beat, name="superinfer-heartbeat", daemon=True)
        thread.start()
        return thread

    def start_watchdog(self, sent: Callable[[], int],
                       on_failure: Callable[[str], None] | None = None) -> threading.Thread:
        """Process 0: watch every follower's heartbeat. A follower whose counter stops
        for ``liveness_timeout_s`` is dead; one whose progress stays behind ``sent()``
        for ``step_timeout_s`` is stuck. Either way ``on_failure`` (default: exit with
        ``EXIT_GROUP_FAILED``: the main thread may be blocked in a collective forever)."""
        cfg = self.config
        fail = on_failure or _exit_group
        followers = range(1, self.num_processes)

        def watch() -> None:
            start = time.monotonic()
            seen: dict[int, tuple[str, float]] = {p: ("", start) for p in followers}
            progress: dict[int, tuple[int, float]] = {p: (-1, start) for p in followers}
            while not self._ended.wait(cfg.liveness_timeout_s / 8):
                now = time.monotonic()
                for p in followers:
                    raw = self.try_get(self.beat_key(p))
                    text = raw.decode() if raw else ""
                    if text != seen[p][0]:
                        seen[p] = (text, now)
                    elif now - seen[p][1] > cfg.liveness_timeout_s:
                        fail(f"process {p} stopped answering: no heartbeat for "
                             f"{now - seen[p][1]:.0f} s (it died, or its host is "
                             "unreachable); the group cannot continue without it")
                        return
                    done = int(text.split(":")[1]) if text else -1
                    # from its last progress or from when it fell behind
                    if done != progress[p][0] or max(done, 0) >= sent():
                        progress[p] = (done, now)
                    elif now - progress[p][1] > cfg.step_timeout_s:
                        fail(f"process {p} is stuck: it has run {done} of the {sent()} "
                             f"step messages process 0 sent, and none for "
                             f"{now - progress[p][1]:.0f} s")
                        return

        thread = threading.Thread(target=watch, name="superinfer-watchdog", daemon=True)
        thread.start()
        return thread


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _exit_group(message: str) -> None:
    print(f"superinfer: error: process group failed: {message}", file=sys.stderr, flush=True)
    os._exit(EXIT_GROUP_FAILED)
