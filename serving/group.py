"""``superinfer serve`` as one process of a multi-host group (docs/tensor_parallel.md).

Every process runs the same command with the same configuration; only where it stands in
the group differs: ``--coordinator HOST:PORT --num-processes N --process-id I``, or JAX's
own ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID`` (a flag wins
over its variable). Process 0 serves: its fronts bind first (live, not ready), then it
joins the group, loads its slices of the model and builds its engine with
``superinfer_jax.dist.multihost.leader_engine`` (``LeaderEngine``, the factory
``serving.server.serve`` builds the engine with). The others bind nothing: they join,
load their slices and replay process 0's device calls (``follow_group``) until process 0
ends the group, which it does after its drain; then they exit 0.

Why these are flags and environment variables, not deployment-file keys: they are the
one thing that differs between the processes of a group (a LeaderWorkerSet gives each pod
its index and its leader's address in the environment), while the file is the same for
every process and is what the processes compare at start-up: each publishes its
fingerprint (``fingerprint``: every key of the file as resolved, less the ``server``
section, which only process 0 uses and which holds the API key, plus the group's
timeouts), and a process whose fingerprint differs from process 0's is refused by every
process, naming the key.

Exit codes: 2 for what the operator must fix (a bad flag, a configuration that differs,
a coordinator that cannot be reached within ``--group-init-timeout-s``), 1 when a formed
group breaks (a lost process), 0 after a clean end.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Mapping
from types import FrameType
from typing import Any

from serving.config_schema import KEYS
from serving.deploy_config import DeploymentConfig
from serving.server import load_model_of
from superinfer_jax.config_schema import ConfigError
from superinfer_jax.dist.distributed import DistributedConfig, Group, GroupError, flatten_config

log = logging.getLogger("superinfer.group")

# DistributedConfig field -> (flag, environment variable or None).
FLAGS: dict[str, tuple[str, str | None]] = {
    "coordinator": ("--coordinator", "JAX_COORDINATOR_ADDRESS"),
    "num_processes": ("--num-processes", "JAX_NUM_PROCESSES"),
    "process_id": ("--process-id", "JAX_PROCESS_ID"),
    "init_timeout_s": ("--group-init-timeout-s", None),
    "liveness_timeout_s": ("--group-liveness-timeout-s", None),
    "step_timeout_s": ("--group-step-timeout-s", None),
}
HELP = {
    "coordinator": "HOST:PORT of process 0, where the group meets (process 0 binds the "
                   "port; $JAX_COORDINATOR_ADDRESS)",
    "num_processes": "processes in the group, process 0 included ($JAX_NUM_PROCESSES)",
    "process_id": "this process, 0..N-1; 0 serves, the others replay its device calls "
                  "($JAX_PROCESS_ID)",
    "init_timeout_s": "seconds to reach the coordinator and see every process (default 60)",
    "liveness_timeout_s": "process 0 ends the group when a process is silent this long "
                          "(default 10)",
    "step_timeout_s": "process 0 ends the group when a process runs no device call this "
                      "long while behind (default 120)",
}


def add_flags(p: argparse.ArgumentParser) -> None:
    """The group's flags on ``serve``. They are read as text: a bad value is then our
    error naming the flag (and exit 2 before any port is bound), not a usage message."""
    group = p.add_argument_group("multi-host tensor parallelism (docs/tensor_parallel.md)")
    metavars = {"coordinator": "HOST:PORT", "num_processes": "N", "process_id": "I"}
    for name, (flag, _) in FLAGS.items():
        group.add_argument(flag, dest=f"group_{name}", default=None,
                           metavar=metavars.get(name, "SECONDS"), help=HELP[name])


def group_config(args: argparse.Namespace, env: Mapping[str, str]) -> DistributedConfig | None:
    """The group this process joins (None: it runs alone), or a ``ConfigError`` naming
    the flag (and the variable, when the value came from there)."""
    values: dict[str, Any] = {}
    source: dict[str, str] = {}
    for name, (flag, var) in FLAGS.items():
        raw = getattr(args, f"group_{name}")
        source[name] = flag
        if raw is None and var is not None and var in env:
            raw, source[name] = env[var], f"{flag} (${var})"
        if raw is not None:
            values[name] = raw
    if "coordinator" not in values:
        alone = [FLAGS[n][0] for n in values]
        if alone:
            raise ConfigError("--coordinator", f"is required with {', '.join(alone)} "
                              "(where the group meets: HOST:PORT of process 0)")
        return None
    for name in ("num_processes", "process_id"):
        if name not in values:
            raise ConfigError(FLAGS[name][0], f"is required with a coordinator (or "
                                              f"${FLAGS[name][1]})")
    for name, raw in values.items():
        if name == "coordinator":
            continue
        kind = float if name in ("liveness_timeout_s", "step_timeout_s") else int
        try:
            values[name] = kind(raw)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise ConfigError(source[name], f"must be {what}, got {raw!r}") from None
    try:
        return DistributedConfig(**values)
    except ValueError as e:  # "process_id: must be in [0, 1] for num_processes 2, got 5"
        field, _, message = str(e).partition(": ")
        if field not in FLAGS:
            raise
        for name, (flag, _) in FLAGS.items():  # name the flags in the message too
            message = message.replace(f"for {name} ", f"for {flag} ")
        raise ConfigError(source[field], message) from None


def fingerprint(config: DeploymentConfig, dist: DistributedConfig) -> dict[str, Any]:
    """What every process of a group must agree on: each key of the file as it resolves
    (``model.kv_cache_dtype: auto`` compared as the dtype it means), without the
    ``server`` section, plus the group's own settings."""
    out: dict[str, Any] = {}
    for path, key in KEYS.items():
        if key.section == "server" or not key.target:  # the preset: its knobs compare
            continue
        value: Any = config
        for part in key.target:
            value = getattr(value, part)
        out[path] = value
    out.update({f"group.{name}": getattr(dist, name) for name in
                ("coordinator", "init_timeout_s", "liveness_timeout_s", "step_timeout_s",
                 "cpu_collectives")})
    return flatten_config(out)


def _join(config: DeploymentConfig, dist: DistributedConfig) -> Group:
    """Join the group, compare configurations, and check the mesh spans every process."""
    import jax

    from superinfer_jax.dist.multihost import start_group

    log.info("joining the group at %s as process %d of %d", dist.coordinator,
             dist.process_id, dist.num_processes)
    group = start_group(dist, fingerprint(config, dist))
    devices = jax.devices()
    check_mesh(config.engine.model.tensor_parallel_size, [d.process_index for d in devices],
               dist.num_processes)
    log.info("group formed: %d processes, %d devices (%d here)", dist.num_processes,
             len(devices), jax.local_device_count())
    return group


def check_mesh(tp: int, device_processes: list[int], num_processes: int) -> None:
    """The mesh (the first ``tp`` of the group's devices, ``device_processes`` giving
    each one's process) must hold devices of every process: a process outside it would
    replay calls on arrays it holds no part of. Every process reaches the same verdict."""
    holders = set(device_processes[:tp])
    left_out = sorted(set(range(num_processes)) - holders)
    if left_out:
        raise ConfigError("model.tensor_parallel_size", f"is {tp}: the mesh (the first {tp} "
                          f"of the group's {len(device_processes)} devices) leaves out "
                          f"process(es) {left_out}; across {num_processes} processes it must "
                          f"span every process's devices (e.g. {len(device_processes)})")


class LeaderEngine:
    """Process 0's ``EngineFactory``: join, load its slices, build the recorded engine;
    ``close`` (after the drain) tells the followers to exit."""

    def __init__(self, dist: DistributedConfig):
        self.dist = dist
        self.recorder: Any = None

    def build(self, config: DeploymentConfig) -> tuple[Any, Any]:
        from superinfer_jax.dist.multihost import leader_engine, warm_up

        group = _join(config, self.dist)
        model = load_model_of(config)
        engine_config = config.engine_config()
        engine, self.recorder = leader_engine(model, engine_config, group, warm=False)
        if engine_config.engine.warmup:
            warm_up(engine, self.recorder)
        return engine, model

    def close(self) -> None:
        if self.recorder is None:
            return
        try:
            self.recorder.stop()
            log.info("told the other %d process(es) to stop", self.dist.num_processes - 1)
        except Exception as e:  # noqa: BLE001 - the group is gone already: they know
            log.warning("could not tell the other processes to stop: %s", e)


class _Interrupted(Exception):
    """A stop signal before this follower had joined and loaded."""


def follow_group(config: DeploymentConfig, dist: DistributedConfig) -> int:
    """A follower's whole life: join, load, replay process 0's calls until it ends the
    group. A stop signal before the replay starts exits at once; during the replay it is
    noted and the process waits for process 0 (which drains first and then ends the
    group; leaving earlier would fail its last steps). A second signal exits 1 at once."""
    following = False
    signals = 0

    def handler(signum: int, frame: FrameType | None) -> None:
        nonlocal signals
        signals += 1
        name = signal.Signals(signum).name
        if not following:
            raise _Interrupted(name)
        if signals > 1:
            print(f"superinfer: error: {name} again: leaving the group before process 0 "
                  "ended it", file=sys.stderr, flush=True)
            os._exit(1)
        log.info("received %s: process 0 ends the group once it has drained", name)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    from superinfer_jax.dist.multihost import follow

    try:
        group = _join(config, dist)
        model = load_model_of(config)
        following = True
        log.info("process %d following process 0", dist.process_id)
        follow(model, config.engine_config(), group)
    except _Interrupted as e:
        log.info("stopped by %s before following", e)
        return 0
    except GroupError as e:
        if not following:
            raise
        print(f"superinfer: error: process group failed: {e}", file=sys.stderr, flush=True)
        return 1
    log.info("process 0 ended the group; bye")
    return 0
