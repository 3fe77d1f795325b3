"""Token sampling on the device, inside the jitted step, so only token ids cross to host.

Each row carries its own parameters. A row's random key is derived from its seed and its
position, so a seeded request samples the same tokens however it is batched, rotated or
recomputed. When every row is greedy the sort for top-k/top-p is skipped entirely.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from superinfer_jax.model_api import StepArray


@jax.tree_util.register_dataclass
@dataclass
class SamplingInputs:
    temperature: StepArray  # [B] float32, 0 = greedy
    top_k: StepArray  # [B] int32, 0 = off
    top_p: StepArray  # [B] float32, 1 = off
    seeds: StepArray  # [B] uint32
    positions: StepArray  # [B] int32, position of the token being sampled

    @staticmethod
    def greedy(batch: int) -> SamplingInputs:
        return SamplingInputs(
            temperature=np.zeros(batch, np.float32),
            top_k=np.zeros(batch, np.int32),
            top_p=np.ones(batch, np.float32),
            seeds=np.zeros(batch, np.uint32),
            positions=np.zeros(batch, np.int32),
        )


def _sample_rows(logits: jax.Array, s: SamplingInputs) -> jax.Array:
    masked = masked_logits(logits, s)
    sampled = jax.vmap(jax.random.categorical)(sample_keys(s), masked)
    return jnp.where(s.temperature > 0, sampled, greedy_tokens(logits))


def sample_keys(s: SamplingInputs) -> jax.Array:
    """Each row's key: its seed folded with the position it samples."""
    return jax.vmap(lambda seed, pos: jax.random.fold_in(jax.random.key(seed), pos))(
        s.seeds, s.positions)


def masked_logits(logits: jax.Array, s: SamplingInputs) -> jax.Array:
    """The logits a sampled row draws from: scaled by its temperature, tokens outside its
    top-k and top-p at -inf (the distribution speculative decoding's acceptance uses)."""
    vocab = logits.shape[-1]
    scaled = logits / jnp.maximum(s.temperature, 1e-6)[:, None]
    sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]  # descending
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    cum = jnp.cumsum(probs, axis=-1)
    # smallest prefix whose mass reaches top_p: keep tokens whose preceding mass < top_p
    keep_sorted = (cum - probs) < s.top_p[:, None]
    num_keep = jnp.maximum(keep_sorted.sum(axis=-1), 1)
    pth = jnp.take_along_axis(sorted_logits, (num_keep - 1)[:, None], axis=-1)
    threshold = jnp.maximum(kth, pth)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def greedy_tokens(logits: jax.Array) -> jax.Array:
    """``argmax`` over the last axis (the first of equal maxima), as a max and a min:
    XLA:CPU's (value, index) reduction for ``argmax`` is several times slower."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    iota = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.min(jnp.where(logits == top, iota, logits.shape[-1] - 1), axis=-1)


def sample(logits: jax.Array, s: SamplingInputs) -> jax.Array:
    """logits [B, V] float32 -> token ids [B] int32."""
    greedy = greedy_tokens(logits)
    return jax.lax.cond(
        jnp.any(s.temperature > 0),
        lambda: _sample_rows(logits, s).astype(jnp.int32),
        lambda: greedy,
    )


SEED32_MAX = 2**32 - 1


def sampler_seed(seed: int) -> int:
    """A request seed (any integer in [0, 2**64)) as the sampler's 32-bit key seed: as it
    is when it fits, else folded with splitmix64's finalizer (high bits still count)."""
    if seed <= SEED32_MAX:
        return seed
    z = seed & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    z ^= z >> 31
    return (z ^ (z >> 32)) & SEED32_MAX
