"""Converted-weights cache: a GGUF's dequantised model kept on disk, so a restart reads
it instead of converting again.

Loading a GGUF reads its metadata entry by entry, dequantises every tensor and
un-permutes Q and K; the result is the same for the same file. The first load writes it
(``params.safetensors`` in model layout and the requested dtype, ``tokenizer.json``, the
config) as one entry per (GGUF path, dtype) under the cache directory (the server passes
its compilation cache directory: one place to wipe).

An entry is used only while its ``meta.json`` (written last, by rename) matches the
source's resolved path, size, modification time, the dtype and the format version; else,
or when it fails to read (a warning), the source is loaded and the entry rewritten.
Writing is best effort: an unwritable cache costs a warning, never the load.
Tensor-parallel loads read an entry but do not write one: their weights are in the
padded sharded layout, not the model's own.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from models.config import PRESETS, ModelConfig
from models.loaders.sink import ParamSink
from models.loaders.sources import EMBEDDED_PRESETS, ORBAX_MARKER, embedded_gguf_path
from models.servable import LlamaServable
from models.tokenizer import Tokenizer

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
CACHE_SUBDIR = "superinfer-weights"
PARAMS_FILE = "params.safetensors"
TOKENIZER_FILE = "tokenizer.json"
META_FILE = "meta.json"  # written last: its presence marks a complete entry

Loader = Callable[..., LlamaServable]  # load_model's signature, called without a cache


def gguf_source(name_or_path: str | Path) -> Path | None:
    """The GGUF file ``load_model(name_or_path)`` converts, or None (another format: an
    Orbax or Hugging Face directory is read as is)."""
    key = str(name_or_path)
    if key in PRESETS:
        return embedded_gguf_path(key) if key in EMBEDDED_PRESETS else None
    path = Path(key).expanduser()
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1 or (path / "config.json").is_file() \
                or (path / ORBAX_MARKER).is_file():
            return None
        path = ggufs[0]
    if not path.is_file():
        return None
    with open(path, "rb") as f:
        return path.resolve() if f.read(4) == b"GGUF" else None


def source_facts(source: Path, dtype: str) -> dict[str, Any]:
    """What an entry is valid for: the file (path, size, modification time), the dtype
    and this module's format."""
    st = source.stat()
    return {"format_version": FORMAT_VERSION, "source": str(source.resolve()),
            "size": st.st_size, "mtime_ns": st.st_mtime_ns, "dtype": dtype}


def entry_dir(cache_dir: str | Path, source: Path, dtype: str) -> Path:
    """The entry of one (source path, dtype): a changed source rewrites it in place."""
    name = hashlib.sha256(f"{source.resolve()}\0{dtype}".encode()).hexdigest()[:16]
    return Path(cache_dir).expanduser() / CACHE_SUBDIR / f"{source.stem}-{dtype}-{name}"


def load_cached(cache_dir: str | Path, name_or_path: str | Path, dtype: str,
                tensor_parallel_size: int, load: Loader) -> LlamaServable:
    """``load(name_or_path, dtype, tensor_parallel_size)`` through the cache: read from
    a valid entry, else loaded from the source (and an entry written)."""
    source = gguf_source(name_or_path)
    if source is None:
        return load(name_or_path, dtype, tensor_parallel_size)
    entry = entry_dir(cache_dir, source, dtype)
    facts = source_facts(source, dtype)
    if _valid(entry, facts):
        try:
            return read_entry(entry, dtype, tensor_parallel_size)
        except Exception as e:  # a damaged entry: the source still loads
            log.warning("weights cache %s is unreadable (%s: %s); loading %s instead",
                        entry, type(e).__name__, e, source)
    servable = load(name_or_path, dtype, tensor_parallel_size)
    if servable.mesh is None:
        try:
            write_entry(entry, servable, facts)
        except OSError as e:
            log.warning("weights cache %s not written (%s)", entry, e)
    return servable


def _valid(entry: Path, facts: dict[str, Any]) -> bool:
    try:
        meta = json.loads((entry / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False  # no entry yet (a damaged meta.json is rewritten like a stale one)
    return isinstance(meta, dict) and meta.get("facts") == facts


def write_entry(entry: Path, servable: LlamaServable, facts: dict[str, Any]) -> None:
    """Write ``servable`` (one device) as ``entry``: into a temporary directory beside
    it, renamed into place, so a reader never sees a partial entry."""
    from safetensors.numpy import save_file

    from models.sharding import flat_state

    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
    try:
        tensors = {_key(p): _storable(np.asarray(w))
                   for p, w in flat_state(servable.params).items()}
        save_file(tensors, str(tmp / PARAMS_FILE))
        del tensors
        tokenizer = servable.tokenizer
        if isinstance(tokenizer, Tokenizer):
            (tmp / TOKENIZER_FILE).write_text(tokenizer.to_json_str(), encoding="utf-8")
        meta = {"facts": facts, "config": servable.config.to_dict(),
                "tokenizer": tokenizer.meta() if isinstance(tokenizer, Tokenizer) else None}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1), encoding="utf-8")
        shutil.rmtree(entry, ignore_errors=True)  # a stale entry of an older source
        os.replace(tmp, entry)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_entry(entry: Path, dtype: str, tensor_parallel_size: int = 1) -> LlamaServable:
    """The servable an entry holds; raises on anything missing or malformed."""
    from safetensors import safe_open

    from superinfer_jax.dist.parallel import make_mesh

    meta = json.loads((entry / META_FILE).read_text(encoding="utf-8"))
    config = ModelConfig.from_dict(meta["config"])
    tokenizer = None
    if meta.get("tokenizer") is not None:
        text = (entry / TOKENIZER_FILE).read_text(encoding="utf-8")
        tokenizer = Tokenizer.from_json_str(text, meta["tokenizer"])
    mesh = make_mesh(tensor_parallel_size) if tensor_parallel_size > 1 else None
    sink = ParamSink(config, dtype, mesh)
    source = str(entry / PARAMS_FILE)
    with safe_open(source, framework="np") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            sink.put(_path(name), _loaded(f.get_tensor(name), dtype), f"{source}: {name}")
    return sink.servable(source, tokenizer)


def _key(path: tuple[str | int, ...]) -> str:
    return ".".join(str(p) for p in path)


def _path(key: str) -> tuple[str | int, ...]:
    return tuple(int(p) if p.isdigit() else p for p in key.split("."))


def _storable(array: np.ndarray) -> np.ndarray:
    """safetensors' numpy API has no bfloat16: those are kept as their raw 16 bits."""
    return array.view(np.uint16) if array.dtype.name == "bfloat16" else array


def _loaded(array: np.ndarray, dtype: str) -> np.ndarray:
    if array.dtype == np.uint16 and dtype == "bfloat16":
        import ml_dtypes

        return array.view(ml_dtypes.bfloat16)
    return array


