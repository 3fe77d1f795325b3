"""Where the native ops and the mypyc build keep what they build, and how an environment
switch reads. Standard library only: the mypyc build imports it first."""

from __future__ import annotations

import os
from pathlib import Path

_OFF = ("0", "false", "no", "off")


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/superinfer_jax`` (default ``~/.cache/superinfer_jax``)."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "superinfer_jax"


def switched_on(variable: str) -> bool:
    """False when ``variable`` is ``0``, ``false``, ``no`` or ``off`` (any case); true when
    unset or anything else."""
    return os.environ.get(variable, "1").strip().lower() not in _OFF
