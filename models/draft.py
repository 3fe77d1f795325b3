"""The draft model of ``speculative.method: draft``, loaded by whoever loads the target
(the CLI, the servers, benchmarks) and handed to ``LLMEngine(..., draft_model=...)``.

``speculative.draft_model`` names it as ``model.name`` / ``model.path`` name the target
(a preset, a .gguf file or a model directory), in the target's dtype and over the same
tensor-parallel devices. ``speculative.draft_quantization`` quantizes its weights at load
(the target's own model in int8: the quantized self-draft), and
``speculative.draft_layers`` keeps only its first N decoder layers, then its final norm
and head (``first_layers``: a cheaper, less accurate self-draft), and
``speculative.draft_vocab`` keeps only the head columns of the N most frequent tokens
(``ranked_head``, FR-Spec: the head is a fifth of SmolLM2's weights, read every draft step;
the ranking is ``models.vocab_rank``'s, committed for the tokenizer). A guess outside
those N is never proposed; the target still verifies every guess, so output is unchanged.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

from models import quant, vocab_rank
from models.servable import LlamaServable
from models.sharding import ShardPlan
from superinfer_jax.config import SpeculativeConfig
from superinfer_jax.config_schema import ConfigError
from superinfer_jax.spec.draft import check_head_ids


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


def ranked_head(model: LlamaServable, ids: np.ndarray) -> LlamaServable:
    """``model`` whose head scores only the tokens ``ids`` (its logit column ``i`` is
    token ``ids[i]``, recorded as ``head_token_ids`` for the proposer to map back); the
    other weights are the same arrays. Quantized heads keep their columns' scales."""
    if model.plan is not None:
        raise ConfigError("speculative.draft_vocab", "a tensor-parallel draft keeps its "
                          "full head (its columns are split over the devices)")
    ids = check_head_ids(ids, model)  # the proposer's own rule, before any column is cut
    module = nnx.merge(model.graphdef, model.params)
    head = module.lm_head[...]
    if isinstance(head, quant.QuantizedWeight):
        head = quant.QuantizedWeight(head.unpacked_q[:, ids], head.scale[ids], w8a8=head.w8a8)
    else:
        head = head[:, ids]
    module.lm_head = nnx.Param(head)
    out = LlamaServable(model.config, module, model.tokenizer, model.dtype, model.plan,
                        model.compute_dtype, model.quantization)
    out.head_token_ids = ids
    return out


def frequent_head(model: LlamaServable, num_tokens: int) -> LlamaServable:
    """``ranked_head`` on the ``num_tokens`` most frequent tokens of the committed
    ranking for ``model``'s tokenizer (``models.vocab_rank``)."""
    if num_tokens >= model.vocab_size:
        return model
    ranking = vocab_rank.find(model.tokenizer)
    if ranking is None:
        raise ConfigError("speculative.draft_vocab", "no token-frequency ranking in "
                          "models/data for the draft's tokenizer: build one with "
                          "python -m models.vocab_rank --model MODEL --name NAME")
    return ranked_head(model, ranking.top(num_tokens))


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
    model = model.quantized(spec.draft_quantization)
    if spec.draft_vocab is not None:
        model = frequent_head(model, spec.draft_vocab)
    return model
