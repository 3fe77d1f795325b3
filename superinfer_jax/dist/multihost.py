"""One engine over several hosts: process 0 runs the engine, the others replay its calls.

Start-up, on every process, in this order (``serving.cli`` and the tests do exactly this):

1. ``start_group``: join the group (``distributed.initialize``, before any other JAX call)
   and refuse it unless every process has the same configuration;
2. load the model onto the global mesh: each process places only its own devices' slices
   (``models.load_model(..., tensor_parallel_size=N)`` builds the mesh over
   ``jax.devices()``, which now lists every host's devices);
3. process 0: ``leader_engine`` (an ``LLMEngine`` whose device calls are recorded, with
   the watchdog running; it serves as any engine does and calls ``Recorder.stop`` at
   exit); every other process: ``follow``, which returns when process 0 stops the group.

The engine is built with its warm-up deferred until the recorder is attached, so the
compile calls of warm-up are on the tape too: the followers compile the same buckets.
``leader_engine(..., warm=False)`` hands the recorder back before warming up (``warm_up``
then), so a caller that may be interrupted during the long warm-up (``serving.group``)
can still tell the followers to stop.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from superinfer_jax.config import EngineConfig
from superinfer_jax.dist.distributed import DistributedConfig, Group, flatten_config, initialize
from superinfer_jax.engine import LLMEngine
from superinfer_jax.dist.lockstep import Recorder, run_follower
from superinfer_jax.model_api import ServableModel


def start_group(dist: DistributedConfig, config: Mapping[str, Any] | Any) -> Group:
    """Join the group and check that every process has ``config`` (a dataclass or a
    mapping; compared key by key, flattened)."""
    group = initialize(dist)
    group.check_same_config(flatten_config(config))
    return group


def leader_engine(model: ServableModel, config: EngineConfig, group: Group,
                  warm: bool = True) -> tuple[LLMEngine, Recorder]:
    """Process 0's engine: every device call it makes goes to the followers first.
    ``warm=False``: not warmed up yet even when ``config.warmup`` (call ``warm_up``)."""
    engine = LLMEngine(model, config.replace(warmup=False))
    recorder = Recorder(engine.runner, group)
    group.start_watchdog(lambda: recorder.sent)
    if warm and config.warmup:
        warm_up(engine, recorder)
    return engine, recorder


def warm_up(engine: LLMEngine, recorder: Recorder) -> None:
    """Process 0's warm-up (every bucket compiled and run once, on the tape: the
    followers compile by replaying it), sent at once rather than with the first step."""
    engine.warmup()
    recorder.flush()


def follow(model: ServableModel, config: EngineConfig, group: Group) -> None:
    """A follower: the same runner as process 0's (the engine is built only for it: the
    same construction, the same clamps), then its calls until process 0 stops.

    With ``config.warmup`` the follower compiles the programs process 0's warm-up
    compiles, in the same order on as many threads, while process 0 does, and replays
    once they are compiled. Replaying alone would compile each program at its first
    run, one at a time, while process 0 waits in that run's collectives (and, on a slow
    host, past ``step_timeout_s``)."""
    engine = LLMEngine(model, config.replace(warmup=False))
    ready = engine.runner.compilation.compile_ahead().wait_done if config.warmup else None
    run_follower(engine.runner, group, ready)
