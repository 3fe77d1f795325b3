"""Speculative decoding under tensor parallelism, on 2 virtual CPU devices:
``python -m tests.superinfer_jax.spec_tp_check``. The 8-KV-head Llama of ``tp_check`` at
TP=2 with n-gram speculation (k = 3), and with a draft model (the target's first layer,
sharded like it), must give TP=1's greedy tokens without it; prints a JSON object
(``identical``, ``accepted``, ``draft_identical``, ``draft_accepted``)."""

from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache-dir")
    args = ap.parse_args()
    import jax

    jax.config.update("jax_num_cpu_devices", 2)
    if args.cache_dir:
        jax.config.update("jax_compilation_cache_dir", args.cache_dir)
    import numpy as np

    from models.servable import random_servable
    from superinfer_jax import EngineConfig, LLMEngine, SamplingParams
    from superinfer_jax.dist.parallel import make_mesh
    from tests.superinfer_jax.tp_check import _llama8_config

    cfg = _llama8_config()
    base = random_servable(cfg, seed=3)
    rng = np.random.default_rng(5)
    prompts = [(rng.integers(0, cfg.vocab_size, 5).tolist() * 4)[:int(n)] for n in (11, 17)]
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    config = EngineConfig.build(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32,
                                max_prefill_chunk=16, max_prefill_rows=1, page_size=8,
                                show_progress=False, warmup=False)

    def run(engine):
        ids = [engine.add_request(p, sp) for p in prompts]
        while engine.has_unfinished_requests():
            engine.step()
        return [engine.release(r).output_token_ids for r in ids]

    want = run(LLMEngine(base, config))
    engine = LLMEngine(base.shard(make_mesh(2)), config.replace(
        tensor_parallel_size=2, speculative_method="ngram", num_speculative_tokens=3))
    got = run(engine)
    from models.draft import first_layers

    drafting = LLMEngine(base.shard(make_mesh(2)), config.replace(
        tensor_parallel_size=2, speculative_method="draft", speculative_draft_model="x",
        num_speculative_tokens=3), draft_model=first_layers(base, 1))
    drafted = run(drafting)
    print(json.dumps({"identical": got == want,
                      "accepted": engine.stats().spec_decode.num_accepted_tokens,
                      "draft_identical": drafted == want,
                      "draft_accepted": drafting.stats().spec_decode.num_accepted_tokens}))


if __name__ == "__main__":
    main()
