"""Device-side token feedback: step t+1 reads the tokens step t sampled without the host.

Async scheduling dispatches step t+1 before the host knows the tokens step t samples. A
row of step t+1 whose input token is one of them names where it lies: ``source[row]``
indexes the concatenation of step t's three sampled arrays (prefill call, decode call,
deferred sampling), each padded to a fixed ``width`` so no new step variant compiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from superinfer_jax.model_api import StepArray

NO_SOURCE = -1  # the row's first token comes from the host


@jax.tree_util.register_dataclass
@dataclass
class TokenFeedback:
    source: StepArray  # [B] int32: NO_SOURCE, or an index into the three arrays below
    prev_prefill: jax.Array  # [width] int32: tokens the previous step's prefill call sampled
    prev_decode: jax.Array  # [width] int32: tokens the previous step's decode call sampled
    prev_deferred: jax.Array  # [width] int32: its deferred (structured-output) samples

    @staticmethod
    def none(rows: int, empty: jax.Array) -> TokenFeedback:
        """Every row's tokens come from the host; ``empty`` is a committed [width] array."""
        return TokenFeedback(np.full(rows, NO_SOURCE, np.int32), empty, empty, empty)


def apply_feedback(tokens: StepArray, feedback: TokenFeedback) -> jax.Array:
    """``tokens`` [B, C] with column 0 replaced where a row names a device source."""
    fed = jnp.concatenate([feedback.prev_prefill, feedback.prev_decode,
                           feedback.prev_deferred])
    source = feedback.source
    first = jnp.where(source >= 0, fed[jnp.maximum(source, 0)], tokens[:, 0])
    return jnp.asarray(tokens).at[:, 0].set(first)  # traced: asarray is a no-op


def pad_sampled(sampled: jax.Array, width: int) -> jax.Array:
    """[B] sampled tokens padded to the fixed feedback ``width`` (B <= width)."""
    return jnp.zeros(width, jnp.int32).at[: sampled.shape[0]].set(sampled)
