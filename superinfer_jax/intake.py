"""Request intake: the bounds only the model can check, applied where the model is known.

``SamplingParams`` and ``SLO`` check every bound they can on their own
(``request.FIELD_RANGES``); what needs the vocabulary or the context length is checked or
fitted here, by ``LLMEngine.add_request``, so the Python API is covered exactly like the
servers: prompt and stop token ids in the vocabulary, a prompt that leaves room for one
new token, ``top_k`` clamped to the vocabulary, and the seed folded into the sampler's
32 bits (an unseeded random request gets one at intake, so a rotation or a recomputation
replays the same tokens).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from superinfer_jax.request import FieldError, SamplingParams
from superinfer_jax.runner.sampling import sampler_seed


def check_prompt(prompt_token_ids: Sequence[Any], vocab_size: int,
                 max_model_len: int) -> list[int]:
    """The prompt as plain ints, or a ``FieldError`` naming ``prompt``."""
    prompt = list(prompt_token_ids)
    if not prompt:
        raise FieldError("prompt", "prompt must not be empty")
    if len(prompt) >= max_model_len:
        raise FieldError(
            "prompt",
            f"prompt has {len(prompt)} tokens; max_model_len is {max_model_len} (prompt "
            "must leave room for one new token)")
    if any(isinstance(t, bool) or not isinstance(t, int | np.integer)
           or not 0 <= t < vocab_size for t in prompt):
        raise FieldError("prompt", f"prompt token ids must be in [0, {vocab_size})")
    return [int(t) for t in prompt]


def fit_sampling(sampling: SamplingParams, vocab_size: int,
                 seed_rng: np.random.Generator) -> SamplingParams:
    """``sampling`` checked against the vocabulary and fitted to the sampler."""
    bad = [t for t in sampling.stop_token_ids if t >= vocab_size]
    if bad:
        raise FieldError("stop_token_ids",
                         f"stop_token_ids must be in [0, {vocab_size}), got {bad[0]}")
    bad = [t for t, _ in sampling.logit_bias if t >= vocab_size]
    if bad:
        raise FieldError("logit_bias", f"logit_bias token ids must be in [0, {vocab_size}), "
                                       f"got {bad[0]}")
    changes: dict[str, Any] = {}
    if sampling.top_k > vocab_size:
        changes["top_k"] = vocab_size
    if sampling.seed is None and not sampling.greedy:
        changes["seed"] = int(seed_rng.integers(0, 2**31))
    elif sampling.seed is not None:
        changes["seed"] = sampler_seed(sampling.seed)
    return dataclasses.replace(sampling, **changes) if changes else sampling
