"""The draft model of ``speculative.method: draft``, loaded by whoever loads the target
(the CLI, the servers, benchmarks) and handed to ``LLMEngine(..., draft_model=...)``.

``speculative.draft_model`` names it as ``model.name`` / ``model.path`` name the target
(a preset, a .gguf file or a model directory), in the target's dtype and over the same
tensor-parallel devices. ``speculative.draft_quantization`` quantizes its weights at load
(the target's own model in int8: the quantized self-draft), and
``speculative.draft_layers`` keeps only its first N decoder layers, then its final norm
and head (``first_layers``: a cheaper, less accurate self-draft).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from flax import nnx

from models.servable import LlamaServable
from models.sharding import ShardPlan
from superinfer_jax.config import SpeculativeConfig
from superinfer_jax.config_schema import ConfigError


def first_layers(model: LlamaServable, num_layers: int) -> LlamaServable:
    """``model`` with only its first ``num_layers`` decoder layers (the same arrays), its
    final norm and head; quantize after, as ``quantized`` asks."""
    total = model.config.num_layers
    if not 1 <= num_layers <= total:
        raise ConfigError("speculative.draft_layers", f"must be between 1 and the draft "
                          f"model's {total} layers, got {num_layers}")
    if num_layers == total:
        return model
    module = nnx.merge(model.graphdef, model.params)
    module.layers = nnx.List(list(module.layers)[:num_layers])
    module.cfg = dataclasses.replace(module.cfg, num_layers=num_layers)
    config = dataclasses.replace(model.config, num_layers=num_layers)
    plan = None if model.plan is None else ShardPlan(config, model.plan.mesh)
    return LlamaServable(config, module, model.tokenizer, model.dtype, plan,
                         model.compute_dtype, model.quantization)


def load_draft(spec: SpeculativeConfig, dtype: str, tensor_parallel_size: int = 1,
               weights_cache: str | Path | None = None) -> Any:
    """The configured draft model, or None when ``speculative.method`` is not draft."""
    if spec.method != "draft":
        return None
    if not spec.draft_model:
        raise ConfigError("speculative.draft_model", "must name a model when "
                          "speculative.method is draft")
    from models.loaders import load_model

    try:
        model = load_model(spec.draft_model, dtype=dtype,
                           tensor_parallel_size=tensor_parallel_size,
                           weights_cache=weights_cache)
    except (ValueError, OSError) as e:
        raise ConfigError("speculative.draft_model", f"cannot load {spec.draft_model!r}: "
                          f"{e}") from e
    if spec.draft_layers is not None:
        model = first_layers(model, spec.draft_layers)
    return model.quantized(spec.draft_quantization)
