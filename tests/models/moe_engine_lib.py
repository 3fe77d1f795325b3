"""Tiny random MoE models and the engine runs their invariance tests share, in this
process (one device) and in ``moe_tp_check`` (virtual devices): Mixtral-style (every
layer routed, top-2 of 8) and Qwen3-MoE-style (q/k norms, head_dim != hidden / heads, a
dense layer among routed ones, top-2 of 8 without renormalising)."""

from __future__ import annotations

import numpy as np

from models.config import ModelConfig, MoEConfig
from superinfer_jax import EngineConfig, LLMEngine, SamplingParams

MODELS = {
    "mixtral": ModelConfig(
        name="tiny-mixtral", vocab_size=256, hidden_size=64, intermediate_size=96,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256,
        moe=MoEConfig(num_experts=8, top_k=2, intermediate_size=96)),
    "qwen3_moe": ModelConfig(
        name="tiny-qwen3-moe", vocab_size=256, hidden_size=64, intermediate_size=128,
        num_layers=3, num_heads=4, num_kv_heads=2, head_dim=24, max_position_embeddings=256,
        qk_norm=True, moe=MoEConfig(num_experts=8, top_k=2, intermediate_size=32,
                                    norm_topk_prob=False, sparse_layers=(0, 2))),
}
# Few compiled shapes: decode 1/2/4 rows, prefill 1 row x 16 columns (longer prompts are
# chunked); 11 usable pages of 8 tokens, the batch needs about 30.
ENGINE = EngineConfig.build(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                            max_prefill_chunk=16, max_prefill_rows=1, page_size=8,
                            num_device_pages=12, num_host_pages=64, show_progress=False,
                            warmup=False)


def prompts() -> list[list[int]]:
    """Six prompts of 3-40 tokens (the long ones prefill in chunks of 16); the last two
    extend the first, so they hit its cached pages."""
    rng = np.random.default_rng(0)
    out = [rng.integers(0, 250, size=int(n)).tolist() for n in (40, 5, 23, 12)]
    return out + [out[0][:32] + [7, 8, 9], out[0] + [1]]


SAMPLING = SamplingParams(max_tokens=16, ignore_eos=True)


def run_forced(engine: LLMEngine, every: int) -> list:
    """All prompts at once; every ``every`` steps a running request is forced out (it
    rotates to the host tier, or is recomputed without one)."""
    ids = [engine.add_request(p, SAMPLING) for p in prompts()]
    step = 0
    while engine.has_unfinished_requests():
        engine.step()
        engine.kv.check_invariants()
        step += 1
        assert step < 100_000, "no progress"
        running = [r.req_id for r in engine.scheduler.running]
        if step % every == 0 and len(running) > 1:
            engine.force_rotate_out(running[step % len(running)])
    return [engine.release(rid) for rid in ids]


def run_alone(engine: LLMEngine) -> list[list[int]]:
    out = []
    for p in prompts():
        rid = engine.add_request(p, SAMPLING)
        while engine.has_unfinished_requests():
            engine.step()
        out.append(engine.release(rid).output_token_ids)
    return out
