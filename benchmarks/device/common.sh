# Preamble shared by the device scripts; sourced by them (after their `set -euo pipefail`),
# never run. The scripts are run as `bash benchmarks/device/X.sh` from anywhere, on a GPU
# machine or a CPU-only one, so this puts them in the repo root, picks the interpreter and
# the output folder, and gives them the GPU probes; one copy keeps those choices the same.
#
# Sets: PY (the Python to run: $PYTHON, else the repo's .venv, else python3) and OUT_DIR
# ($OUT, else results/; created).

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
OUT_DIR=${OUT:-results}
mkdir -p "$OUT_DIR"

# Succeeds when JAX's default backend is a GPU (the scripts fall back to a CPU smoke run).
jax_has_gpu() {
  "$PY" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")'
}

# Prints each GPU's name, total memory and the extra nvidia-smi fields given (comma
# separated) for the log; prints nothing, and never fails, without nvidia-smi.
gpu_info() {
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu="name,memory.total${1:+,$1}" \
    --format=csv,noheader || true
}
