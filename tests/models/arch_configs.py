"""Tiny random configs of the architectures beyond the Llama family (Qwen3, Mixtral,
Qwen3-MoE), built with transformers' own config classes: the variants the parity tests
cover (GQA, head_dim != hidden / heads, top-k 1, 2 and 8, norm_topk_prob both ways,
dense layers among routed ones)."""

from __future__ import annotations

from tests.models.conftest import TINY_VOCAB


def qwen3(**over):
    from transformers import Qwen3Config

    # head_dim 24 with hidden 64 and 4 heads: not hidden / heads (16)
    kw = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
              max_position_embeddings=256, rope_theta=1e6, rms_norm_eps=1e-6,
              tie_word_embeddings=False, eos_token_id=2)
    return Qwen3Config(**{**kw, **over})


def mixtral(**over):
    from transformers import MixtralConfig

    kw = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
              rope_theta=1e6, rms_norm_eps=1e-5, sliding_window=None, bos_token_id=1,
              eos_token_id=2)
    return MixtralConfig(**{**kw, **over})


def qwen3_moe(**over):
    from transformers import Qwen3MoeConfig

    kw = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
              moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=1, head_dim=32, num_experts=8, num_experts_per_tok=2,
              norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
              max_position_embeddings=256, rope_theta=1e6, rms_norm_eps=1e-6,
              tie_word_embeddings=False, eos_token_id=2)
    return Qwen3MoeConfig(**{**kw, **over})


# name -> config: what test_numerics_arch checks against transformers
VARIANTS = {
    "qwen3": lambda: qwen3(),
    "mixtral_top2": lambda: mixtral(),
    "mixtral_top1": lambda: mixtral(num_experts_per_tok=1, num_local_experts=4),
    "qwen3_moe_top2_norm": lambda: qwen3_moe(),
    "qwen3_moe_top8_nonorm": lambda: qwen3_moe(num_experts_per_tok=8, norm_topk_prob=False,
                                               num_experts=8, mlp_only_layers=[],
                                               decoder_sparse_step=2),
}
