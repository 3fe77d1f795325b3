"""Logits processing and logprobs on the device, inside the jitted step.

Between the model's logits and the sampler, per row: ``logit_bias``, ``min_tokens`` (EOS
and the stop token ids masked), a structured-output grammar's token mask, then vLLM's
penalties (repetition over prompt and output, CTRL's rule; then frequency and presence
over the output, OpenAI's rule). After sampling, the logprobs of the sampled token and
its top-k alternatives, and for prefill rows that ask, of every prompt token.

Every feature sits behind a ``lax.cond`` on "does any row of this call use it", and an
unused feature's inputs are committed constants, so a batch that uses none pays only for
the test; shapes are fixed per step bucket, so no feature adds a compiled variant.
Penalties are stateless: a row carries its token history (the step's own tokens are added
on the device, where a fed-back token is known), so rotation, recomputation and
prefix-cache hits have nothing to keep consistent. Logprobs are of the raw model
distribution (vLLM's default ``raw_logprobs``).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from superinfer_jax.dist.parallel import host_value
from superinfer_jax.model_api import StepArray, StepInputs
from superinfer_jax.request import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_TOKEN_IDS,
    TokenLogprobs,
)

BIAS_WIDTH = MAX_LOGIT_BIAS + MAX_STOP_TOKEN_IDS  # logit_bias, then min_tokens' stop ids
NO_TOKEN = -1  # padding in the history and bias rows


def mask_words(vocab_size: int) -> int:
    """int32 words of a row's token bitmask: bit ``t % 32`` of word ``t // 32``."""
    return -(-vocab_size // 32)


@jax.tree_util.register_dataclass
@dataclass
class LogitsInputs:
    """Per-row logits processing and logprob requests of one step (host-built)."""

    prompt_lens: StepArray  # [B] int32: positions below are prompt, from here output
    presence: StepArray  # [B] float32, 0 = off
    frequency: StepArray  # [B] float32, 0 = off
    repetition: StepArray  # [B] float32, 1 = off
    history: StepArray  # [B, H] int32: token at each position before the step, or -1
    bias_ids: StepArray  # [B, BIAS_WIDTH] int32 token ids, -1 = unused
    bias_values: StepArray  # [B, BIAS_WIDTH] float32 (-inf masks a token)
    suppress_eos: StepArray  # [B] bool: min_tokens not reached, EOS masked
    masked: StepArray  # [B] bool: the row follows a grammar mask
    mask: StepArray  # [B, W] int32 token bitmask (bit set = allowed)
    want_logprobs: StepArray  # [B] bool
    want_prompt_logprobs: StepArray  # [B] bool
    targets: StepArray  # [B, C] int32: the prompt token each column predicts
    deferred_rows: StepArray  # [D] int32: rows sampled later (``resample``), -1 = none


@jax.tree_util.register_dataclass
@dataclass
class StepLogprobs:
    """Logprobs a step computed (zeros where no row asked). ``prompt_*`` are per column:
    column j of a row predicts the prompt token at position ``positions[j] + 1``."""

    logprob: jax.Array  # [B] the sampled token's
    rank: jax.Array  # [B] 1 = most likely
    top_ids: jax.Array  # [B, K]
    top_logprobs: jax.Array  # [B, K]
    prompt_logprob: jax.Array  # [B, C]
    prompt_rank: jax.Array  # [B, C]
    prompt_top_ids: jax.Array  # [B, C, K]
    prompt_top_logprobs: jax.Array  # [B, C, K]


def process_logits(logits: jax.Array, inputs: StepInputs, li: LogitsInputs,
                   eos_token_ids: tuple[int, ...]) -> jax.Array:
    """logits [B, V] -> the logits the sampler draws from. ``inputs`` are the step's
    (feedback applied): their valid tokens count in the penalty history."""
    vocab = logits.shape[-1]
    rows = jnp.arange(logits.shape[0])[:, None]

    def bias(x):
        ids = li.bias_ids
        return x.at[rows, jnp.where(ids >= 0, ids, vocab)].add(li.bias_values, mode="drop")

    logits = jax.lax.cond(jnp.any(li.bias_ids >= 0), bias, lambda x: x, logits)
    if eos_token_ids:
        eos = jnp.asarray(eos_token_ids, jnp.int32)

        def no_eos(x):
            return jnp.where(li.suppress_eos[:, None], x.at[:, eos].set(-jnp.inf), x)

        logits = jax.lax.cond(jnp.any(li.suppress_eos), no_eos, lambda x: x, logits)

    def grammar(x):
        bit = jnp.arange(vocab)
        allowed = (li.mask[:, bit // 32] >> (bit % 32)) & 1
        return jnp.where(li.masked[:, None] & (allowed == 0), -jnp.inf, x)

    logits = jax.lax.cond(jnp.any(li.masked), grammar, lambda x: x, logits)
    penalised = (li.presence != 0) | (li.frequency != 0) | (li.repetition != 1)
    return jax.lax.cond(
        jnp.any(penalised),
        lambda x: _penalties(x, inputs, li),
        lambda x: x, logits)


def _penalties(logits: jax.Array, inputs: StepInputs, li: LogitsInputs) -> jax.Array:
    batch, vocab = logits.shape
    hist_pos = jnp.broadcast_to(jnp.arange(li.history.shape[1]), li.history.shape)
    cols = jnp.arange(inputs.tokens.shape[1])[None, :]
    step_ids = jnp.where(cols < inputs.query_lens[:, None], inputs.tokens, NO_TOKEN)
    ids = jnp.concatenate([li.history, step_ids], axis=1)
    pos = jnp.concatenate([hist_pos, inputs.positions], axis=1)
    valid = (ids >= 0) & (pos < inputs.context_lens[:, None])
    output = valid & (pos >= li.prompt_lens[:, None])
    rows = jnp.arange(batch)[:, None]
    safe = jnp.where(valid, ids, vocab)  # out of range: dropped
    counts = jnp.zeros((batch, vocab), jnp.int32).at[rows, safe].add(
        output.astype(jnp.int32), mode="drop")
    seen = jnp.zeros((batch, vocab), jnp.int32).at[rows, safe].max(
        valid.astype(jnp.int32), mode="drop") > 0
    rep = li.repetition[:, None]
    repeated = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(seen, repeated, logits)
    return (logits - li.frequency[:, None] * counts
            - li.presence[:, None] * (counts > 0).astype(logits.dtype))


def _top(logits: jax.Array, chosen: jax.Array) -> tuple[jax.Array, ...]:
    """(chosen's logprob, its rank, top-K ids, top-K logprobs) over the last axis, from
    raw logits: ranks and the top K are the logits' own, so only the K + 1 values that
    are returned get the log-sum-exp subtracted (no [.., V] log-softmax is written)."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, chosen[..., None], axis=-1)[..., 0]
    # counted in float32 (exact below 2**24 tokens): XLA:CPU's int32 count is far slower
    above = jnp.where(logits > picked[..., None], 1.0, 0.0)
    rank = 1 + jnp.sum(above, axis=-1).astype(jnp.int32)
    top, top_ids = jax.lax.top_k(logits, MAX_LOGPROBS)
    return picked - lse, rank, top_ids.astype(jnp.int32), top - lse[..., None]


def sampled_logprobs(logits: jax.Array, sampled: jax.Array,
                     li: LogitsInputs) -> tuple[jax.Array, ...]:
    """Raw logprobs of the sampled tokens and their top-K, when any row asks."""
    batch = logits.shape[0]
    zeros = (jnp.zeros(batch, jnp.float32), jnp.zeros(batch, jnp.int32),
             jnp.zeros((batch, MAX_LOGPROBS), jnp.int32),
             jnp.zeros((batch, MAX_LOGPROBS), jnp.float32))
    return jax.lax.cond(
        jnp.any(li.want_logprobs),
        lambda: _top(logits, sampled),
        lambda: zeros)


def prompt_logprobs(project, hidden: jax.Array, li: LogitsInputs) -> tuple[jax.Array, ...]:
    """Raw logprobs of every column's next prompt token, when any prefill row asks;
    ``project`` maps hidden states [B, C, H] to logits [B, C, V] (the model's head), and
    runs only then: most calls never pay for the full-sequence head."""
    zeros = no_prompt_logprobs(*li.targets.shape)

    def compute():
        return _top(project(hidden), li.targets)

    return jax.lax.cond(jnp.any(li.want_prompt_logprobs), compute, lambda: zeros)


def deferred_logits(logits: jax.Array, li: LogitsInputs) -> jax.Array:
    """The raw logits [D, V] of the rows whose sampling is deferred."""
    return logits[jnp.maximum(li.deferred_rows, 0)]


def no_prompt_logprobs(batch: int, cols: int) -> tuple[jax.Array, ...]:
    return (jnp.zeros((batch, cols), jnp.float32), jnp.zeros((batch, cols), jnp.int32),
            jnp.zeros((batch, cols, MAX_LOGPROBS), jnp.int32),
            jnp.zeros((batch, cols, MAX_LOGPROBS), jnp.float32))


def neutral_logits_inputs(rows: int, cols: int, history_width: int,
                          vocab_size: int, deferred_rows: int = 1) -> LogitsInputs:
    """Inputs that change nothing and ask for nothing (warm-up, padding, profiling)."""
    return LogitsInputs(
        prompt_lens=np.zeros(rows, np.int32),
        presence=np.zeros(rows, np.float32),
        frequency=np.zeros(rows, np.float32),
        repetition=np.ones(rows, np.float32),
        history=np.full((rows, history_width), NO_TOKEN, np.int32),
        bias_ids=np.full((rows, BIAS_WIDTH), NO_TOKEN, np.int32),
        bias_values=np.zeros((rows, BIAS_WIDTH), np.float32),
        suppress_eos=np.zeros(rows, np.bool_),
        masked=np.zeros(rows, np.bool_),
        mask=np.full((rows, mask_words(vocab_size)), -1, np.int32),
        want_logprobs=np.zeros(rows, np.bool_),
        want_prompt_logprobs=np.zeros(rows, np.bool_),
        targets=np.zeros((rows, cols), np.int32),
        deferred_rows=np.full(deferred_rows, -1, np.int32),
    )


@dataclass
class HostLogprobs:
    """A call's ``StepLogprobs`` read to the host, sliced per row as requests ask."""

    arrays: dict[str, np.ndarray]

    def sampled(self, b: int, token_id: int, k: int) -> TokenLogprobs:
        """Row ``b``'s sampled token ``token_id`` with its top ``k``."""
        a = self.arrays
        return _token(token_id, a["logprob"][b], a["rank"][b], a["top_ids"][b],
                      a["top_logprobs"][b], k)

    def prompt(self, b: int, j: int, token_id: int, k: int) -> TokenLogprobs:
        """Row ``b``'s column ``j``: the prompt token ``token_id`` it predicts."""
        a = self.arrays
        return _token(token_id, a["prompt_logprob"][b, j], a["prompt_rank"][b, j],
                      a["prompt_top_ids"][b, j], a["prompt_top_logprobs"][b, j], k)


def _token(token_id: int, logprob, rank, top_ids, top_logprobs, k: int) -> TokenLogprobs:
    top = tuple((int(t), float(v)) for t, v in zip(top_ids[:k], top_logprobs[:k], strict=True))
    return TokenLogprobs(token_id, float(logprob), int(rank), top)


def read_logprobs(logprobs: StepLogprobs) -> HostLogprobs:
    """Block on a call's logprobs and copy them to the host (one transfer per array)."""
    return HostLogprobs({name: host_value(getattr(logprobs, name))
                         for name in StepLogprobs.__dataclass_fields__})
