"""Our own checkpoint format: Orbax params + JSON config + tokenizer, beside each other.

An Orbax checkpoint holds the parameters in model layout, so restoring is a straight
read into the abstract state (cast by Orbax), with no dequantize/transpose pass.

Layout of a saved directory::

    params/                 Orbax StandardCheckpointer output (the NNX param state)
    tokenizer.json          tokenizers.Tokenizer.to_str(), when the model has a tokenizer
    superinfer_model.json   config, dtype and tokenizer metadata; written last, so its
                            presence marks a complete checkpoint
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh

from models.config import ModelConfig
from models.loaders.sink import abstract_model
from models.loaders.sources import ORBAX_MARKER
from models.servable import LlamaServable, check_dtype
from models.sharding import ShardPlan, fill_state, flat_state
from models.tokenizer import Tokenizer

FORMAT_VERSION = 1
PARAMS_DIR = "params"
TOKENIZER_FILE = "tokenizer.json"


def save_orbax(servable: LlamaServable, path: str | Path) -> Path:
    """Write ``servable`` to ``path`` (created if needed; an earlier save is replaced)."""
    path = Path(path).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    marker = path / ORBAX_MARKER
    marker.unlink(missing_ok=True)  # an interrupted overwrite must not look complete
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path / PARAMS_DIR, servable.params, force=True)
        checkpointer.wait_until_finished()
    tokenizer = servable.tokenizer
    if isinstance(tokenizer, Tokenizer):
        (path / TOKENIZER_FILE).write_text(tokenizer.to_json_str(), encoding="utf-8")
    meta = {
        "format_version": FORMAT_VERSION,
        "dtype": servable.dtype,
        "config": servable.config.to_dict(),
        "tokenizer": tokenizer.meta() if isinstance(tokenizer, Tokenizer) else None,
    }
    marker.write_text(json.dumps(meta, indent=2), encoding="utf-8")
    return path


def _read_meta(path: Path) -> dict[str, Any]:
    marker = path / ORBAX_MARKER
    try:
        meta = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{marker}: unreadable model metadata ({e})") from e
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{marker}: unsupported format_version {meta.get('format_version')!r}")
    return meta


def _load_tokenizer(path: Path, meta: dict[str, Any] | None) -> Tokenizer | None:
    if meta is None:
        return None
    file = path / TOKENIZER_FILE
    try:
        return Tokenizer.from_json_str(file.read_text(encoding="utf-8"), meta)
    except Exception as e:
        raise ValueError(f"{file}: cannot load tokenizer ({e})") from e


def load_orbax(path: str | Path, dtype: str = "float32",
               mesh: Mesh | None = None) -> LlamaServable:
    """Restore a ``save_orbax`` directory straight into a ``dtype`` model state.

    With a ``mesh``, each device reads only its slice of every tensor the sharded layout
    keeps as saved; a tensor whose heads the layout pads or replicates is read split (or
    replicated, when its size does not divide) and converted on device."""
    path = Path(path).expanduser().resolve()
    check_dtype(dtype)
    meta = _read_meta(path)
    try:
        config = ModelConfig.from_dict(meta["config"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path / ORBAX_MARKER}: invalid model config ({e})") from e
    graphdef, abstract_state = abstract_model(config, dtype)
    plan = ShardPlan(config, mesh) if mesh is not None else None
    if plan is not None:
        abstract_state = _with_restore_shardings(abstract_state, plan)
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            state = checkpointer.restore(path / PARAMS_DIR, abstract_state)
    except Exception as e:
        raise ValueError(f"{path / PARAMS_DIR}: cannot restore Orbax params "
                         f"({type(e).__name__}: {e})") from e
    tokenizer = _load_tokenizer(path, meta.get("tokenizer"))
    if plan is None:
        return LlamaServable(config, nnx.merge(graphdef, state), tokenizer, dtype)
    graphdef, sharded = abstract_model(plan.module_config, dtype)
    fill_state(sharded, {p: plan.reshard(p, w) for p, w in flat_state(state).items()})
    return LlamaServable(config, nnx.merge(graphdef, sharded), tokenizer, dtype, plan)


def _with_restore_shardings(abstract_state: nnx.State, plan: ShardPlan) -> nnx.State:
    """The abstract state with, on every leaf, where each device should read it to."""
    leaves = {
        p: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=plan.restore_sharding(p, a.shape))
        for p, a in flat_state(abstract_state).items()
    }
    fill_state(abstract_state, leaves)
    return abstract_state
