"""The verify call: rows of 1 + k tokens scored in one forward pass over the paged KV.

Row ``b`` holds a request's last token and the tokens proposed after it, at their
positions; the pass scores each of the 1 + k positions as its own decode row
(``as_decode_rows``), so its logits are bit for bit those of decoding one token at a
time, in bfloat16 too (a multi-column prefill row sums in another order, and a near-tie
would flip the argmax). The pass writes their KV (the rejected ones' is overwritten
later: the request's ``num_computed_tokens`` only counts what was accepted) and returns
the target's greedy token at every column. Greedy rows (temperature 0) accept by the argmax rule:
the longest prefix of the proposal the target agrees with, plus the target's next token,
so the output is exactly what decoding one token at a time gives. Sampled rows use the
rejection rule of speculative sampling (``_sampled``), so each emitted token is
distributed exactly as the target's (the same seed draws other tokens than without
speculation: the draws are spent differently).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from superinfer_jax.model_api import ServableModel, StepInputs
from superinfer_jax.runner.logits import MAX_LOGPROBS, _top
from superinfer_jax.runner.sampling import (
    SamplingInputs,
    greedy_tokens,
    masked_logits,
    sample_keys,
)


def make_verify(model: ServableModel, treedef: Any, backend: str,
                out_shardings: Any = None, rule: str = "exact") -> Any:
    """The jitted verify program, pool donated: (params leaves, pool, inputs, want
    logprobs [B] bool, sampling [B * C] (row-major), proposals [B, C]: the guess column
    ``j`` checks, -1 for none, masked [B] bool and masks [B, C, words] int32: each
    column's grammar bitmask) -> (tokens [B, C], accepted [B, C] bool, the emitted
    tokens' logprobs from the raw logits [4 arrays], pool). ``rule``: ``exact``;
    ``resample_target`` is a deliberately wrong rule (a rejected guess redrawn from the
    target's distribution, not the residual) that the distribution test must tell
    apart."""

    def verify(param_leaves, kv_pool, inputs: StepInputs, want_logprobs,
               sampling: SamplingInputs, proposals, masked, masks):
        params = jax.tree.unflatten(treedef, param_leaves)
        rows, cols = inputs.tokens.shape
        # each column a decode row: the exact computation plain decoding does
        raw, kv_pool, _ = model.forward(params, kv_pool, as_decode_rows(inputs),
                                        attention_backend=backend, return_hidden=True)
        raw = raw.reshape(rows, cols, raw.shape[-1])
        logits = jax.lax.cond(jnp.any(masked), lambda: _grammar(raw, masked, masks),
                              lambda: raw)
        greedy = greedy_tokens(logits)  # the sampler's greedy rule, every column
        tokens, accepted = jax.lax.cond(
            jnp.any(sampling.temperature > 0),
            lambda: _sampled(logits, greedy, sampling, proposals, rule),
            lambda: (greedy, greedy == proposals))
        emitted = jnp.where(accepted, proposals, tokens)
        zeros = (jnp.zeros((rows, cols), jnp.float32), jnp.zeros((rows, cols), jnp.int32),
                 jnp.zeros((rows, cols, MAX_LOGPROBS), jnp.int32),
                 jnp.zeros((rows, cols, MAX_LOGPROBS), jnp.float32))
        logprobs = jax.lax.cond(jnp.any(want_logprobs), lambda: _top(raw, emitted),
                                lambda: zeros)
        return tokens, accepted, logprobs, kv_pool

    if out_shardings is None:
        return jax.jit(verify, donate_argnums=(1,))
    return jax.jit(verify, donate_argnums=(1,), out_shardings=out_shardings)


def as_decode_rows(inputs: StepInputs) -> StepInputs:
    """Verify rows [B, C] as B * C one-column decode rows (row-major): column ``j`` of
    row ``b`` becomes a decode row of the same request (its page table) whose context
    ends at its own position, so its logits come from the kernels and shapes plain
    decoding uses (the decode path is batch-invariant: a row's bits do not depend on the
    other rows). Every layer writes all rows' K/V before it attends, so column ``j`` sees
    the K/V of the columns before it. A padding column (``j >= query_lens[b]``) is a
    padding decode row: it writes the null page and sees no context."""
    rows, cols = inputs.tokens.shape
    valid = jnp.arange(cols)[None, :] < inputs.query_lens[:, None]  # [B, C]
    return StepInputs(
        tokens=inputs.tokens.reshape(rows * cols, 1),
        positions=inputs.positions.reshape(rows * cols, 1),
        query_lens=valid.reshape(-1).astype(jnp.int32),
        context_lens=jnp.where(valid, inputs.positions + 1, 0).reshape(-1).astype(jnp.int32),
        page_tables=jnp.repeat(inputs.page_tables, cols, axis=0))


def _grammar(logits: jax.Array, masked: jax.Array, masks: jax.Array) -> jax.Array:
    """Tokens a masked row's grammar forbids at each column set to -inf (the bit layout
    of ``structured.grammar``: token t is bit t % 32 of word t // 32)."""
    vocab = logits.shape[-1]
    bit = jnp.arange(vocab)
    allowed = (masks[:, :, bit // 32] >> (bit % 32)) & 1
    return jnp.where(masked[:, None, None] & (allowed == 0), -jnp.inf, logits)


def _sampled(logits: jax.Array, greedy: jax.Array, s: SamplingInputs, proposals: jax.Array,
             rule: str) -> tuple[jax.Array, jax.Array]:
    """Speculative sampling with a deterministic proposer (q one-hot on the guess x):
    accept x with probability p(x), p the distribution the sampler draws from (the same
    temperature, top-k and top-p); on rejection draw from p with x removed, which is
    norm(max(p - q, 0)). The emitted token is then distributed exactly as p. The column
    after the last guess (no guess: -1) draws from p itself. Greedy rows keep the argmax
    rule."""
    rows, cols, vocab = logits.shape
    flat = logits.reshape(rows * cols, vocab)
    masked = masked_logits(flat, s)
    guess = proposals.reshape(-1)
    has_guess = guess >= 0
    logp = jax.nn.log_softmax(masked, axis=-1)
    p_guess = jnp.where(has_guess, jnp.exp(jnp.take_along_axis(
        logp, jnp.maximum(guess, 0)[:, None], axis=-1)[:, 0]), 0.0)
    keys = jax.vmap(jax.random.split)(sample_keys(s))  # [N, 2]: the test, the draw
    u = jax.vmap(jax.random.uniform)(keys[:, 0])
    accept = has_guess & (u < p_guess)
    residual = masked
    if rule == "exact":
        residual = jnp.where(has_guess[:, None] & (jnp.arange(vocab)[None, :] == guess[:, None]),
                             -jnp.inf, masked)
    drawn = jax.vmap(jax.random.categorical)(keys[:, 1], residual).astype(jnp.int32)
    sampled = (s.temperature > 0).reshape(rows, cols)
    tokens = jnp.where(sampled, drawn.reshape(rows, cols), greedy)
    return tokens, jnp.where(sampled, accept.reshape(rows, cols), greedy == proposals)


def accepted_length(accepted: np.ndarray, n: int) -> int:
    """Guesses kept: the columns before the first rejected one among the first ``n``."""
    rejected = np.flatnonzero(~np.asarray(accepted[:n], bool))
    return int(rejected[0]) if rejected.size else n
