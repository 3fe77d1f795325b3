"""Suite-wide set-up: a persistent XLA cache, so engines built with the same shapes in
different tests compile once per run instead of once per test, and the scheduler modules
run as plain Python.

Why plain Python: a mypyc build of the scheduler modules (``make compiled``, opt-in, for
simulations) is used whenever one matching the source sits in ``~/.cache``, and CI shares
that cache with the machine that built it. Under a build the tests that hook a method on an
instance fail (``superinfer_jax/mypyc_build/__init__.py`` says why), so a machine with a build would
fail a suite that passes on a fresh one (stop 29's CI did). The suite tests the source;
``SUPERINFER_COMPILED=1 make test`` runs it against a build on purpose, and
``benchmarks.plan_trace`` checks that a build plans what the source plans.
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("SUPERINFER_COMPILED", "0")  # before anything imports superinfer_jax

import jax  # noqa: E402
import pytest  # noqa: E402

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
