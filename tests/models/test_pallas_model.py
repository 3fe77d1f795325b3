"""The model gives the same greedy tokens with the Pallas kernels (interpret mode on CPU)
as with the XLA reference, through the whole engine: chunked prefill, mixed batches with
decode rows, padding rows, shuffled pages."""

from __future__ import annotations

import numpy as np

from models.config import ModelConfig
from models.servable import random_servable
from superinfer_jax import LLM, EngineConfig, SamplingParams

# 3 query heads per KV head and head dim 64, as in the kernel's smallest Triton tiles.
TINY = ModelConfig(name="tiny-gqa3", vocab_size=128, hidden_size=96, intermediate_size=128,
                   num_layers=2, num_heads=6, num_kv_heads=2, head_dim=64,
                   max_position_embeddings=128, eos_token_ids=(127,))


def _generate(backend: str, prompts: list[list[int]]) -> list[list[int]]:
    config = EngineConfig.build(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=24,
                                max_prefill_chunk=12, max_prefill_rows=2, page_size=8,
                                attention_backend=backend, warmup=False, show_progress=False)
    llm = LLM(random_servable(TINY, seed=2), config)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    return [o.token_ids for o in outs]


def test_pallas_greedy_tokens_match_xla():
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 127, size=n).tolist() for n in (3, 17, 9)]
    assert _generate("pallas", prompts) == _generate("xla", prompts)
