"""Model + config -> a warmed-up ``LLMEngine``, the same way for ``serve`` and ``batch``."""

from __future__ import annotations

from typing import Any

from superinfer_jax.config import EngineConfig
from superinfer_jax.engine import LLMEngine


def build_engine(model: Any, config: EngineConfig) -> LLMEngine:
    """Build and warm up. Warm-up runs twice: the first pass starts from a freshly
    allocated (uncommitted) KV pool, so its first bucket is compiled for a pool signature
    that never recurs and would otherwise recompile on the first real decode step (seconds
    of TTFT). The second pass only hits the in-memory jit cache once that is fixed."""
    engine = LLMEngine(model, config)
    if config.warmup:
        engine.warmup()
    return engine
