"""The verify call: rows of 1 + k tokens scored in one forward pass over the paged KV.

Row ``b`` holds a request's last token and the tokens proposed after it, at their
positions; the pass writes their KV (the rejected ones' is overwritten later: the
request's ``num_computed_tokens`` only counts what was accepted) and returns the target's
greedy token at every column. ``greedy_accept`` is the acceptance rule of temperature 0:
the longest prefix of the proposal the target agrees with, plus the target's next token,
so the output is exactly what decoding one token at a time gives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from superinfer_jax.model_api import ServableModel, StepInputs
from superinfer_jax.runner.logits import MAX_LOGPROBS, _top
from superinfer_jax.runner.sampling import greedy_tokens


def make_verify(model: ServableModel, treedef: Any, backend: str,
                out_shardings: Any = None) -> Any:
    """The jitted verify program, pool donated: (params leaves, pool, inputs, want
    logprobs [B] bool) -> (target tokens [B, C], logprobs of those [4 arrays], pool)."""

    def verify(param_leaves, kv_pool, inputs: StepInputs, want_logprobs):
        params = jax.tree.unflatten(treedef, param_leaves)
        logits, kv_pool = model.forward(params, kv_pool, inputs, attention_backend=backend,
                                        all_logits=True)
        target = greedy_tokens(logits)  # the sampler's greedy rule, every column
        rows, cols = target.shape
        zeros = (jnp.zeros((rows, cols), jnp.float32), jnp.zeros((rows, cols), jnp.int32),
                 jnp.zeros((rows, cols, MAX_LOGPROBS), jnp.int32),
                 jnp.zeros((rows, cols, MAX_LOGPROBS), jnp.float32))
        logprobs = jax.lax.cond(jnp.any(want_logprobs), lambda: _top(logits, target),
                                lambda: zeros)
        return target, logprobs, kv_pool

    if out_shardings is None:
        return jax.jit(verify, donate_argnums=(1,))
    return jax.jit(verify, donate_argnums=(1,), out_shardings=out_shardings)


def greedy_accept(proposal: Sequence[int] | np.ndarray, target: np.ndarray) -> int:
    """How many proposed tokens the target accepts: the longest prefix where the target's
    token at column ``i`` (predicting proposal ``i``) equals it. The caller then emits
    ``proposal[:a]`` and ``target[a]``."""
    proposal = np.asarray(proposal)
    n = proposal.shape[0]
    if n == 0:
        return 0
    differ = np.flatnonzero(np.asarray(target[:n]) != proposal)
    return int(differ[0]) if differ.size else n
