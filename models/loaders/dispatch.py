"""``load_model``: the source a name or path means (preset, ``.gguf`` file, Hugging Face
or Orbax directory) and its loader. Each format module is imported when that format is
loaded, so a load imports only its own format's libraries (gguf, safetensors, orbax)."""

from __future__ import annotations

from pathlib import Path

from jax.sharding import Mesh

import models.quant as quant
from models.config import PRESETS
from models.loaders.sources import EMBEDDED_PRESETS, ORBAX_MARKER, embedded_gguf_path
from models.servable import LlamaServable, check_dtype
from superinfer_jax.dist.parallel import make_mesh


def _known() -> str:
    return ", ".join(sorted(PRESETS))


def _load_preset(name: str, dtype: str, mesh: Mesh | None,
                 quantization: str = "none") -> LlamaServable:
    from models.loaders.gguf_loader import load_gguf

    if name not in EMBEDDED_PRESETS:
        raise ValueError(
            f"preset {name!r} has no bundled weights; download its Hugging Face checkpoint "
            f"and pass the directory instead (e.g. --model /path/to/hf-dir containing "
            f"config.json and *.safetensors). Bundled presets: {', '.join(EMBEDDED_PRESETS)}"
        )
    return load_gguf(embedded_gguf_path(name), dtype=dtype, name=name, mesh=mesh,
                     quantization=quantization)


def _load_dir(path: Path, dtype: str, mesh: Mesh | None,
              quantization: str = "none") -> LlamaServable:
    from models.loaders.hf_loader import load_hf_dir
    from models.loaders.orbax_io import load_orbax

    if (path / ORBAX_MARKER).is_file():
        return load_orbax(path, dtype=dtype, mesh=mesh)
    if (path / "config.json").is_file():
        return load_hf_dir(path, dtype=dtype, mesh=mesh)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _load_file(ggufs[0], dtype, mesh, quantization)
    raise ValueError(
        f"{path}: not a model directory: no config.json (Hugging Face) and no "
        f"{ORBAX_MARKER} (saved by save_orbax)"
        + (f"; it holds {len(ggufs)} .gguf files, pass one" if ggufs else "")
    )


def _load_file(path: Path, dtype: str, mesh: Mesh | None,
               quantization: str = "none") -> LlamaServable:
    from models.loaders.gguf_loader import is_gguf_file, load_gguf

    if path.suffix == ".gguf" or is_gguf_file(path):
        return load_gguf(path, dtype=dtype, mesh=mesh, quantization=quantization)
    if path.suffix == ".safetensors":
        raise ValueError(f"{path}: pass the directory holding config.json, not a weight file")
    raise ValueError(f"{path}: unrecognised model file (expected .gguf)")


def load_model(name_or_path: str | Path, dtype: str = "float32",
               tensor_parallel_size: int = 1,
               weights_cache: str | Path | None = None,
               compute_dtype: str = "auto", quantization: str = "none") -> LlamaServable:
    """Load a servable model from a preset name, a .gguf file or a model directory.

    ``tensor_parallel_size > 1`` loads straight into the sharded layout over the first
    that many devices (the engine's mesh). ``weights_cache``: a directory keeping a GGUF's
    converted weights (``models.weights_cache``). ``compute_dtype``: what a bfloat16
    model computes in (``models.servable.resolve_compute``; "auto" picks per platform).
    ``quantization``: ``none | int8 | fp8 | w8a8_int8`` (``models.quant``), quantized on load:
    a GGUF tensor by tensor, any other format once loaded."""
    _check_gguf_blocks(name_or_path, quant.check_mode(quantization))
    quant.check_one_device(quantization, tensor_parallel_size)
    direct = quantization if compute_dtype == "auto" and not weights_cache else "none"
    servable = _load_model(name_or_path, dtype, tensor_parallel_size, weights_cache, direct)
    if compute_dtype != "auto":
        servable = servable.with_compute(compute_dtype)
    return servable.quantized(quantization)


def _check_gguf_blocks(name_or_path: str | Path, quantization: str) -> None:
    """Refuse, before loading, a GGUF whose block format does not map to ``quantization``."""
    from models.weights_cache import gguf_source

    source = gguf_source(name_or_path) if quantization != "none" else None
    if source is not None:
        from models.loaders.gguf_loader import check_quantizable, open_gguf

        check_quantizable(open_gguf(source), source, quantization)


def _load_model(name_or_path: str | Path, dtype: str = "float32",
                tensor_parallel_size: int = 1,
                weights_cache: str | Path | None = None,
                quantization: str = "none") -> LlamaServable:
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
        return _load_preset(key, dtype, mesh, quantization)
    path = Path(key).expanduser()
    if path.is_dir():
        return _load_dir(path, dtype, mesh, quantization)
    if path.is_file():
        return _load_file(path, dtype, mesh, quantization)
    raise ValueError(
        f"{key!r} is neither a known model preset ({_known()}) nor an existing path "
        "(a .gguf file, a Hugging Face directory or a saved Orbax directory)"
    )


def save_orbax(servable: LlamaServable, path: str | Path) -> Path:
    """Save a loaded model so ``load_model(path)`` restores it without conversion."""
    from models.loaders.orbax_io import save_orbax as _save

    if servable.quantization != "none":
        raise ValueError(f"model.quantization: save the float model, not its "
                         f"{servable.quantization} weights (they quantize again on load)")

    return _save(servable, path)
