#!/usr/bin/env bash
# Tensor parallelism on several GPUs (prepared for a multi-GPU machine; sized for under 8
# minutes on 2-8 Hopper GPUs). Not yet run: the machines lent so far have one GPU.
#   1. Correctness: tests.superinfer_jax.tp_check on real devices, TP = 1, 2 (and 4 when
#      there are 4 GPUs): greedy tokens equal to TP=1 with rotations running, collectives
#      in the compiled step (all-reduce per block, no pool gather), host pages split per
#      GPU in pinned host memory. Once with the XLA attention, once with "auto" (Pallas).
#   2. Speed: a Llama-3-8B-shaped model cut to 8 layers (bfloat16, random weights): decode
#      step time at batch 32, context 1024, per TP size; and 64 pages rotated out and back
#      (each GPU moves its own KV heads: the aggregate GB/s should grow with TP).
# JSON to $OUT/tp_*.json (results/ without $OUT).
# Run from anywhere: bash benchmarks/device/tp.sh
set -euo pipefail
source "$(dirname "$0")/common.sh"

NGPU=$("$PY" -c 'import jax; print(sum(d.platform == "gpu" for d in jax.devices()))')
gpu_info
if [ "$NGPU" -lt 2 ]; then
  echo "tp.sh needs at least 2 GPUs visible to JAX (found $NGPU); nothing to do"
  exit 0
fi
TPS=1,2
[ "$NGPU" -ge 4 ] && TPS=1,2,4
echo "GPUs: $NGPU, tensor-parallel sizes: $TPS"

for backend in xla auto; do
  timeout 200 "$PY" -m tests.superinfer_jax.tp_check --tp "$TPS" --backend "$backend" \
    --out "$OUT_DIR/tp_check_$backend.json" >/dev/null
  "$PY" - "$OUT_DIR/tp_check_$backend.json" "$backend" <<'PYEOF'
import json, sys

d = json.load(open(sys.argv[1]))
for case in ("smollm2", "llama8", "replicated"):
    runs = d[case]
    for tp, r in runs.items():
        if tp == "1":
            continue
        same = r["tokens"] == runs["1"]["tokens"]
        ops = {}
        for o in r["step_collectives"]:
            ops[o["op"]] = ops.get(o["op"], 0) + 1
        print(f"[{sys.argv[2]}] {case} tp={tp}: tokens {'equal' if same else 'DIFFER'}, "
              f"{r['rotations']} rotations, collectives {ops}, "
              f"host pages {r['host_pages'].get('memory_kind')} x{r['host_pages'].get('num_shards')}")
for tp, r in d["sink"].items():
    print(f"[{sys.argv[2]}] loader tp={tp}: xla {r['xla']}, pallas {r['pallas']}")
PYEOF
done

timeout 240 "$PY" - "$TPS" "$OUT_DIR/tp_speed.json" <<'PYEOF'
import json, sys, time

import jax
import numpy as np

from models.config import preset
from models.servable import random_servable
from superinfer_jax import EngineConfig, LLMEngine
from superinfer_jax.kv.layout import NULL_PAGE
from superinfer_jax.model_api import StepInputs
from superinfer_jax.parallel import make_mesh
from superinfer_jax.sampling import SamplingInputs

tps = [int(t) for t in sys.argv[1].split(",")]
cfg = preset("llama-3-8b").replace(num_layers=8)
rows, context, pages = 32, 1024, 64
out = {"model": "llama-3-8b x 8 layers, bfloat16", "rows": rows, "context": context, "runs": []}


def best_of(fn, repeats=5):
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


for tp in tps:
    model = random_servable(cfg, dtype="bfloat16", mesh=make_mesh(tp) if tp > 1 else None)
    engine = LLMEngine(model, EngineConfig(
        dtype="bfloat16", max_model_len=2048, max_num_seqs=rows, num_device_pages=4096,
        num_host_pages=4 * pages, attention_backend="auto", warmup=False, show_progress=False,
        tensor_parallel_size=tp))
    table = np.arange(1, context // 16 + 1, dtype=np.int32)
    tables = np.full((rows, engine.config.max_pages_per_seq), NULL_PAGE, np.int32)
    tables[:, :table.size] = table
    inputs = StepInputs.from_numpy(np.ones((rows, 1)), np.full((rows, 1), context - 1),
                                   np.ones(rows), np.full(rows, context), tables)

    def step():
        tokens, engine.kv_pool = engine._step_fn(engine.model.params, engine.kv_pool, inputs,
                                                 SamplingInputs.greedy(rows))
        tokens.block_until_ready()

    duplex = engine.duplex
    ids = list(range(1, pages + 1))

    def rotate():
        staged = duplex.mover.gather(engine.kv_pool, ids)
        host = jax.device_put(staged, duplex.host.host_sharding)
        jax.block_until_ready(jax.device_put(host, duplex.host.device_sharding))

    step_s, rotate_s = best_of(step), best_of(rotate)
    moved = 2 * pages * engine.layout.page_bytes
    run = {"tp": tp, "decode_step_ms": step_s * 1e3, "rotate_out_and_in_ms": rotate_s * 1e3,
           "rotate_GBps_both_ways": moved / rotate_s / 1e9}
    out["runs"].append(run)
    print(f"tp={tp}: decode step {run['decode_step_ms']:.2f} ms, {pages} pages out and back "
          f"{run['rotate_out_and_in_ms']:.2f} ms ({run['rotate_GBps_both_ways']:.1f} GB/s)")
    del engine, model
json.dump(out, open(sys.argv[2], "w"), indent=2)
PYEOF
