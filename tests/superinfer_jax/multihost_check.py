"""One process of a multi-host group on this machine (``test_multihost`` runs two).

Run as ``python -m tests.superinfer_jax.multihost_check``.

``test_multihost`` starts two of these on 127.0.0.1, each with 2 virtual CPU devices and
XLA's gloo collectives, for TP=4 over both: process 0 runs the engine and the requests,
process 1 replays its device calls (``superinfer_jax.dist.lockstep``). Scenarios:

- ``tokens``: the batch of ``PROMPTS`` with a rotation forced every third step on a pool
  too small for all of them (``tp_check.run_rotating``); process 0 writes the greedy
  tokens and the rotation counts to ``--out`` as JSON;
- ``endless``: the same batch again and again (process 0 writes ``--out`` once the first
  round is done), for the test that kills process 1 under load;
- ``idle``: process 0 builds its engine, writes ``--out`` and waits for ever, for the test
  that kills process 0 while process 1 waits for its next message.

The model is a tiny random Llama (4 KV heads, so TP=4 splits them as they are) that the
test process also builds at TP=1 (``model_config``, ``engine_config``, ``PROMPTS``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

SEED = 7


def model_config():
    from models.config import ModelConfig

    return ModelConfig(name="tiny-4kv", vocab_size=256, hidden_size=64, intermediate_size=128,
                       num_layers=2, num_heads=8, num_kv_heads=4, head_dim=16,
                       max_position_embeddings=128)


def prompts() -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(3)
    return [rng.integers(0, 256, size=int(k)).tolist() for k in (9, 21, 14, 27)]


def engine_config(tp: int, max_num_seqs: int = 2):
    from superinfer_jax import EngineConfig

    # 10 device pages of 8 tokens (one of them the null page) for 4 requests of up to 39
    # tokens, 2 running at a time: rotations happen on their own besides the forced ones.
    # No warm-up: steps compile at first use (a compile call is a recorded call like any
    # other). Two rows, not four: decode compiles at most 2 row buckets (1, 2), not 3;
    # the TP=1 reference in test_multihost compiled 4 step shapes with 4 rows, 3 with 2
    # (the pair's first batch compiled 3 either way: it never ran 3 or 4 rows at once).
    # A batch of 2 is as much a batch for the group's protocol as one of 4 (TP=1 here:
    # 18 rotations, 66 pages in).
    return EngineConfig.build(max_model_len=64, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=32,
                              max_prefill_chunk=16, max_prefill_rows=1, page_size=8,
                              num_device_pages=10, num_host_pages=64, transfer_budget_pages=16,
                              attention_backend="xla", show_progress=False, warmup=False,
                              tensor_parallel_size=tp)


MAX_TOKENS = 12


def run_batch(engine) -> dict[str, Any]:
    from tests.superinfer_jax.tp_check import run_rotating

    done = run_rotating(engine, prompts(), MAX_TOKENS, 3, {})
    return {"tokens": [r.output_token_ids for r in done],
            "rotations": sum(r.num_rotations for r in done),
            "pages_in": engine.duplex.stats.pages_in}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--num-processes", type=int, required=True)
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--scenario", default="tokens", choices=("tokens", "endless", "idle"))
    ap.add_argument("--max-num-seqs", type=int, default=2, help="differs: a config mismatch")
    ap.add_argument("--init-timeout", type=int, default=30)
    ap.add_argument("--liveness-timeout", type=float, default=4.0)
    ap.add_argument("--cache-dir", default=None, help="persistent XLA compilation cache")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import jax

    jax.config.update("jax_num_cpu_devices", 2)
    jax.config.update("jax_platforms", "cpu")
    if args.cache_dir:
        jax.config.update("jax_compilation_cache_dir", args.cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    from superinfer_jax.dist.distributed import DistributedConfig, GroupError
    from superinfer_jax.dist.multihost import follow, leader_engine, start_group

    dist = DistributedConfig(args.coordinator, args.num_processes, args.process_id,
                             init_timeout_s=args.init_timeout,
                             liveness_timeout_s=args.liveness_timeout)
    config = engine_config(4, args.max_num_seqs)
    try:
        group = start_group(dist, config)
    except (GroupError, ValueError) as e:
        print(f"multihost_check: error: {e}", file=sys.stderr, flush=True)
        return 2
    from models.servable import random_servable
    from superinfer_jax.dist.parallel import make_mesh

    model = random_servable(model_config(), seed=SEED, mesh=make_mesh(4))
    if not group.is_leader:
        try:
            follow(model, config, group)
        except GroupError as e:
            print(f"multihost_check: error: {e}", file=sys.stderr, flush=True)
            return 1
        return 0
    engine, recorder = leader_engine(model, config, group)
    if args.scenario == "idle":
        Path(args.out).write_text(json.dumps({"ready": True}))
        while True:
            time.sleep(1)
    t0 = time.perf_counter()
    result = run_batch(engine)
    result.update(seconds=round(time.perf_counter() - t0, 2), messages=recorder.sent,
                  devices=len(jax.devices()), local_devices=jax.local_device_count())
    if args.out:
        Path(args.out).write_text(json.dumps(result))
    while args.scenario == "endless":
        run_batch(engine)
    recorder.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
