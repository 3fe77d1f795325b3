"""Suite-wide set-up: a persistent XLA cache, so engines built with the same shapes in
different tests compile once per run instead of once per test."""

from __future__ import annotations

import os
import tempfile

import jax
import pytest

_CACHE = os.environ.get("SUPERINFER_TEST_XLA_CACHE") or os.path.join(
    tempfile.gettempdir(), "superinfer-test-xla-cache"
)
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M, float32, loaded once per session (it takes seconds)."""
    from models import load_model

    return load_model("smollm2-135m", dtype="float32")


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2's tokenizer (``models.tokenizer.Tokenizer``: 49,152 tokens, chat template),
    rebuilt from the embedded GGUF's metadata only: no weights are read. For tiny random
    models that need a real vocabulary (structured outputs, chat templates)."""
    from models.loaders import embedded_gguf_path
    from models.loaders.gguf_loader import _fields, open_gguf
    from models.tokenizer import Tokenizer

    path = embedded_gguf_path("smollm2-135m")
    return Tokenizer.from_gguf_fields(_fields(open_gguf(path), path))
