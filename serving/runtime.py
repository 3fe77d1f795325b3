"""What the fronts share: the server's state, the engine once it is ready, the model's
facts and the metrics.

The fronts start before the model loads, so a client (or a health probe) gets a clear
UNAVAILABLE "warming up" instead of a refused connection. The state only moves forward:
WARMING_UP -> SERVING -> DRAINING -> STOPPED, and every move is told to the listeners
(the gRPC health service), so health is never out of step with admission.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from serving.deploy_config import DeploymentConfig
from serving.metrics import ServingMetrics
from superinfer_jax.async_engine import AsyncEngine, EngineUnavailableError
from superinfer_jax.request import SLO

API_VERSION = "superinfer.v1"


class ServerState(enum.IntEnum):
    WARMING_UP = 1
    SERVING = 2
    DRAINING = 3
    STOPPED = 4


@dataclass(frozen=True)
class ModelInfo:
    name: str
    vocab_size: int
    max_model_len: int
    dtype: str
    kv_cache_dtype: str
    page_size: int
    eos_token_ids: tuple[int, ...]
    policy: str


class Runtime:
    def __init__(self, config: DeploymentConfig):
        self.config = config
        self.state = ServerState.WARMING_UP
        self.engine: AsyncEngine | None = None
        self.tokenizer: Any = None
        self.model_info: ModelInfo | None = None
        self.default_slo: SLO = config.engine.default_slo
        self.metrics = ServingMetrics(config.model.served_name)
        self.created = int(time.time())
        self._lock = threading.Lock()
        self._listeners: list[Callable[[ServerState], None]] = []

    @property
    def served_name(self) -> str:
        return self.config.model.served_name

    def on_state(self, listener: Callable[[ServerState], None]) -> None:
        with self._lock:
            self._listeners.append(listener)
            state = self.state
        listener(state)

    def set_serving(self, engine: AsyncEngine, model: Any) -> None:
        cfg = engine.engine.config
        self.tokenizer = model.tokenizer
        self.model_info = ModelInfo(
            name=self.served_name,
            vocab_size=int(model.vocab_size),
            max_model_len=cfg.model.max_model_len,
            dtype=str(model.dtype),
            kv_cache_dtype=cfg.model.kv_cache_dtype,
            page_size=cfg.hardware.page_size,
            eos_token_ids=tuple(int(t) for t in model.eos_token_ids),
            policy=str(getattr(cfg.engine, "policy", "fcfs")),
        )
        self.engine = engine
        self.metrics.set_cache_config(cfg.hardware.page_size, cfg.model.kv_cache_dtype)
        expert_counts = getattr(model, "expert_counts", None)  # a mixture-of-experts model
        if expert_counts is not None:
            self.metrics.set_expert_counts(expert_counts.by_group)
        self._move(ServerState.SERVING)

    def set_draining(self) -> None:
        self._move(ServerState.DRAINING)

    def set_stopped(self) -> None:
        self._move(ServerState.STOPPED)

    def _move(self, state: ServerState) -> None:
        with self._lock:
            if state <= self.state:
                return
            self.state = state
            listeners = list(self._listeners)
        for listener in listeners:
            listener(state)

    def serving_engine(self) -> AsyncEngine:
        """The engine, or ``EngineUnavailableError`` saying why there is none to use."""
        state, engine = self.state, self.engine
        if state is ServerState.WARMING_UP or engine is None:
            raise EngineUnavailableError("server is warming up: retry shortly")
        if state is not ServerState.SERVING:
            raise EngineUnavailableError("server is draining: not admitting new requests")
        return engine

    def stats(self) -> dict[str, Any]:
        engine = self.engine
        return engine.stats() if engine is not None else {}
