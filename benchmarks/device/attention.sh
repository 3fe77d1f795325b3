#!/usr/bin/env bash
# Paged-attention speed figure on one GPU (sized for an H200, under 4 minutes):
# Llama-3-8B (32/8 heads) and Qwen2.5-32B (40/8 heads) head shapes, head dim 128, batch 64,
# decode at contexts 1k, 4k, 16k, 32k plus one prefill shape, page 16, bfloat16. Prints
# the kernel's and XLA's time and achieved bandwidth against the device-to-device copy
# bandwidth measured in the same run; JSON to $OUT/attention.json (results/ without $OUT).
# Goal: >= 70% of copy bandwidth for long-context decode, kernel/XLA ratio < 1 everywhere.
#
# Without a GPU it still runs (Pallas interpret mode, small --quick shapes): a smoke test,
# not a speed figure. Run from anywhere: bash benchmarks/device/attention.sh [extra args]
set -euo pipefail
source "$(dirname "$0")/common.sh"

if jax_has_gpu; then
  gpu_info clocks.max.memory
  # 32k contexts x 64 rows is an 8.6 GB one-layer pool: leave XLA room for the reference.
  export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
  timeout 225 "$PY" -m benchmarks.attention --out "$OUT_DIR/attention.json" "$@"
else
  echo "no GPU visible to JAX: CPU interpret-mode smoke run (--quick), not a speed figure"
  timeout 225 "$PY" -m benchmarks.attention --quick --out "$OUT_DIR/attention.json" "$@"
fi
