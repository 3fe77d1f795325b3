"""Model and engine configs shared by the engine-level invariance tests.

The rotation and policy invariance tests compare token streams of the same tiny random
model under different memory pressure; they share these so that a change to the model or
to the compiled step shapes reaches both (and the persistent XLA cache serves both).
"""

from __future__ import annotations

from models.config import ModelConfig
from superinfer_jax import EngineConfig

TINY = ModelConfig(name="tiny", vocab_size=256, hidden_size=64, intermediate_size=128,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                   max_position_embeddings=256, eos_token_ids=(255,))
# Few compiled shapes: decode 1/2/4 rows, prefill 1 row x 16 columns.
SMALL = EngineConfig(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                     max_prefill_chunk=16, max_prefill_rows=1, page_size=8,
                     show_progress=False, warmup=False)
# SMALL for the real SmolLM2 (30 layers, about 7 s per compiled step program): every
# SmolLM2 engine test (rotation, policy and prefix-cache invariance) uses these shapes,
# so the persistent XLA cache compiles them once per suite run. 7 usable pages of 16.
SMOLLM2_SMALL = SMALL.replace(page_size=16, num_device_pages=8, num_host_pages=32)


def run_jobs(engine, jobs, rotate_every: int = 0) -> list:
    """Run ``(prompt, sampling)`` jobs to the end and release them (finished requests, in
    order); with ``rotate_every``, every job still running is forced out that often."""
    ids = [engine.add_request(p, sp) for p, sp in jobs]
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if rotate_every and steps % rotate_every == 0:
            for rid in ids:
                engine.force_rotate_out(rid)
    return [engine.release(rid) for rid in ids]
