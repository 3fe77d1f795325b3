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
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from superinfer_jax.config import EngineConfig
from superinfer_jax.distributed import DistributedConfig, Group, flatten_config, initialize
from superinfer_jax.engine import LLMEngine
from superinfer_jax.lockstep import Recorder, run_follower
from superinfer_jax.model_api import ServableModel


def start_group(dist: DistributedConfig, config: Mapping[str, Any] | Any) -> Group:
    """Join the group and check that every process has ``config`` (a dataclass or a
    mapping; compared key by key, flattened)."""
    group = initialize(dist)
    group.check_same_config(flatten_config(config))
    return group


def leader_engine(model: ServableModel, config: EngineConfig, group: Group
                  ) -> tuple[LLMEngine, Recorder]:
    """Process 0's engine: every device call it makes goes to the followers first."""
    engine = LLMEngine(model, config.replace(warmup=False))
    recorder = Recorder(engine.runner, group)
    group.start_watchdog(lambda: recorder.sent)
    if config.warmup:
        engine.warmup()
        recorder.flush()
    return engine, recorder


def follow(model: ServableModel, config: EngineConfig, group: Group) -> None:
    """A follower: the same runner as process 0's (the engine is built only for it: the
    same construction, the same clamps), then its calls until process 0 stops."""
    engine = LLMEngine(model, config.replace(warmup=False))
    run_follower(engine.runner, group)
