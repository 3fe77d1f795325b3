"""The contract between the engine and a model family.

The engine never imports a model. It drives anything that provides:

- ``kv_spec``: the per-token KV shape (layers, KV heads, head dim) the pool is built from;
- ``params``: a pytree of arrays (the NNX state, split once at load time);
- ``forward(params, kv_pool, inputs, ...)``: a pure, jit-traceable step that writes the
  new K/V into the pool and returns logits and the pool (``ServableModel.forward``);
- ``tokenizer`` with ``encode(text) -> list[int]`` and ``decode(ids) -> str``;
- ``eos_token_ids`` and ``max_position_embeddings``.

One step is a padded, ragged batch (``StepInputs``): ``B`` rows of ``query_lens[b]`` new
tokens each, padded to ``C`` columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import jax
import numpy as np


@dataclass(frozen=True)
class KVSpec:
    """What one token of KV cache looks like, for every layer."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


# A step input: numpy on the host while a batch is built, a jax.Array inside the step.
StepArray = jax.Array | np.ndarray


@jax.tree_util.register_dataclass
@dataclass
class StepInputs:
    """Device inputs of one model step. All int32; padding rows have ``query_lens == 0``."""

    tokens: StepArray  # [B, C] token ids, padded with 0
    positions: StepArray  # [B, C] absolute position of each token in its sequence
    query_lens: StepArray  # [B] number of valid tokens in the row
    context_lens: StepArray  # [B] KV length after this step (past + query_lens)
    page_tables: StepArray  # [B, P] device page ids; unused entries point at the null page

    @staticmethod
    def from_numpy(
        tokens: np.ndarray,
        positions: np.ndarray,
        query_lens: np.ndarray,
        context_lens: np.ndarray,
        page_tables: np.ndarray,
    ) -> StepInputs:
        return StepInputs(
            tokens=np.asarray(tokens, np.int32),
            positions=np.asarray(positions, np.int32),
            query_lens=np.asarray(query_lens, np.int32),
            context_lens=np.asarray(context_lens, np.int32),
            page_tables=np.asarray(page_tables, np.int32),
        )


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


class ServableModel(Protocol):
    kv_spec: KVSpec
    params: Any
    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]
    max_position_embeddings: int
    vocab_size: int
    dtype: str

    def forward(
        self,
        params: Any,
        kv_pool: jax.Array,
        inputs: StepInputs,
        *,
        attention_backend: str = "xla",
        all_logits: bool = False,
        return_hidden: bool = False,
        kv_scales: jax.Array | None = None,
    ) -> tuple[jax.Array, ...]:
        """Run one step: (logits, kv_pool), plus ``hidden`` with ``return_hidden``.
        ``kv_scales``: an fp8_e4m3 pool's [L, 2, K] scales, handed to
        ``ops.write_and_attend`` (the engine passes it only for that dtype).
        logits: [B, vocab] float32 at each row's last valid token ([B, C, vocab] with
        ``all_logits``); hidden: [B, C, hidden] final-normed states, for ``project``."""
        ...

    def project(self, params: Any, hidden: jax.Array) -> jax.Array:
        """Final-normed hidden states [..., hidden] -> float32 logits [..., vocab]."""
        ...
