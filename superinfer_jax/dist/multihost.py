"""One engine over several hosts: process 0 runs the engine, the others replay its calls.

Start-up, on every process, in this order (as ``serving.cli`` does):

1. ``start_group``: join the group (before any other JAX call), refused unless every
   process has the same configuration;
2. load the model onto the global mesh (each process places its own devices' slices);
3. process 0: ``leader_engine``, an ``LLMEngine`` whose device calls are recorded (its
   warm-up too, so the followers compile the same buckets); every other process:
   ``follow``, which returns when process 0 stops the group. ``warm=False`` hands the
   recorder back before the long warm-up, so an interrupted caller can still stop them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from superinfer_jax.config import EngineConfig
from superinfer_jax.dist.distributed import DistributedConfig, Group, flatten_config, initialize
from superinfer_jax.dist.lockstep import Recorder, run_follower
from superinfer_jax.engine import LLMEngine
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
    if warm and config.engine.warmup:
        warm_up(engine, recorder)
    return engine, recorder


def warm_up(engine: LLMEngine, recorder: Recorder) -> None:
    """Process 0's warm-up, on the tape, sent at once rather than with the first step."""
    engine.warmup()
    recorder.flush()


def follow(model: ServableModel, config: EngineConfig, group: Group) -> None:
    """A follower: the same runner as process 0's, then its calls until process 0 stops.
    With ``config.warmup`` it compiles warm-up's programs on as many threads while
    process 0 does, and replays once they are compiled (compiling each at its first
    replayed run would keep process 0 waiting in that run's collectives)."""
    engine = LLMEngine(model, config.replace(warmup=False))
    ready = engine.runner.compilation.compile_ahead().wait_done if config.engine.warmup else None
    run_follower(engine.runner, group, ready)
