#!/usr/bin/env bash
# DuplexKV transfer figure on one GPU (sized for an H200, under 4 minutes): Llama-3-8B pages
# (2 MiB, bfloat16), 4 GiB each way: (a) naive per-page-per-layer device_put, (b) the
# batched rotation engine one direction at a time, (c) both directions at once; plus the
# layout measurements and a SmolLM2-shaped decode step with a rotation running. Prints
# GB/s each way against the pinned-host copy peak measured in the same run (one large
# device_put each way) and the issue's goals: batched >= 5x naive, duplex wall <= 0.75 of
# out + in, step slowdown <= 10%. JSON to $OUT/duplex.json (results/ without $OUT).
#
# Without a GPU it still runs (--quick, CPU): a smoke test, not the GPU figure.
# Run from anywhere: bash benchmarks/device/check.sh [extra args for benchmarks.duplex]
set -euo pipefail
source "$(dirname "$0")/common.sh"
JSON="$OUT_DIR/duplex.json"

if jax_has_gpu; then
  gpu_info pcie.link.gen.max
  timeout 225 "$PY" -m benchmarks.duplex --gib 4 --repeats 5 --layouts --out "$JSON" "$@"
else
  echo "no GPU visible to JAX: CPU smoke run (--quick), not the GPU figure"
  timeout 225 "$PY" -m benchmarks.duplex --quick --layouts --out "$JSON" "$@"
fi

"$PY" - "$JSON" <<'PYEOF'
import json, sys

d = json.load(open(sys.argv[1]))
c = d["ceilings"]
print(f"\npinned-host copy peak: out {c['peak_out_GBps']:.1f} GB/s, in {c['peak_in_GBps']:.1f} GB/s"
      f" (memcpy {c['memcpy_GBps']:.1f} GB/s), backend {d['environment']['backend']}")
for r in d["transfers"]:
    print(f"  {r['method']:8s} out {r['out_GBps']:7.2f} GB/s ({r['out_of_peak']:5.0%} of peak)"
          f"   in {r['in_GBps']:7.2f} GB/s ({r['in_of_peak']:5.0%} of peak)")
ok = lambda b: "ok" if b else "MISSED"
x_out, x_in = d["batched_over_naive_out"], d["batched_over_naive_in"]
duplex = d["duplex_wall_over_sequential"]
print(f"batched/naive out {x_out:.1f}x in {x_in:.1f}x [{ok(min(x_out, x_in) >= 5)}]; "
      f"duplex wall/(out+in) {duplex:.2f} [{ok(duplex <= 0.75)}]; "
      f"verified {d['round_trip_verified']}")
if "overlap" in d:
    s = d["overlap"]["slowdown"]
    print(f"step slowdown with a rotation running: {s:+.1%} [{ok(s <= 0.10)}]")
PYEOF
