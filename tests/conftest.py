"""Suite-wide set-up: a persistent XLA cache, so engines built with the same shapes in
different tests compile once per run instead of once per test."""

from __future__ import annotations

import os
import tempfile

import jax

_CACHE = os.environ.get("SUPERINFER_TEST_XLA_CACHE") or os.path.join(
    tempfile.gettempdir(), "superinfer-test-xla-cache"
)
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
