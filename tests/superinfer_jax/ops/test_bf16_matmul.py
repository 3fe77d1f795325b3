"""The native bfloat16 matmul (``ops/native/bf16_matmul.cc``): float32-accurate against a
float64 reference, every row's bits independent of the rows beside it, only in the CPU
program, and an engine on a bfloat16 model giving the same greedy tokens alone and
batched through it. ``make test`` runs the kernel tests once more with
``SUPERINFER_NATIVE_AMX=1``: the AMX tiles, on a CPU that has them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ModelConfig
from models.llama import NATIVE, matmul
from models.servable import random_servable
from superinfer_jax import LLMEngine, SamplingParams
from superinfer_jax.ops import native
from superinfer_jax.sim.report import cpu_description
from tests.numerics import assert_close, f32_tolerance
from tests.superinfer_jax.engine_testlib import SMALL, run_alone, run_jobs

HAVE_KERNEL = native.bf16_matmul_available()
needs_kernel = pytest.mark.skipif(
    not HAVE_KERNEL, reason="this CPU lacks AVX512-BF16 (or no C++ compiler): XLA's dot "
                            "is used, as test_servable_takes_the_kernel_where_there_is_one checks")

# Shapes that reach every path: one row (wide tiles), 2-3 rows, blocks of 4 (4-5 and 8+
# rows) and of 3 (6-7 rows) with remainder row blocks; odd K (the last k pairs with zero);
# N not a multiple of 32 (masked columns), narrower than one tile, and wide (several
# tiles per thread).
SHAPES = [(1, 576, 576), (1, 7, 33), (2, 64, 192), (3, 577, 100), (5, 96, 1536),
          (6, 577, 200), (7, 64, 100), (8, 130, 64), (13, 64, 31), (130, 64, 200)]


def _operands(m: int, k: int, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.05, jnp.bfloat16)
    return x, w


@needs_kernel
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_matches_float64_reference(m: int, k: int, n: int) -> None:
    x, w = _operands(m, k, n)
    got = jax.jit(native.bf16_matmul)(x, w)
    assert got.dtype == jnp.float32 and got.shape == (m, n)
    # Products of bfloat16 values are exact in float32, so the only error is the float32
    # sum of k terms: float32's bound over the terms' magnitude.
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    assert_close(got, x64 @ w64, f32_tolerance(np.abs(x64) @ np.abs(w64), k),
                 f"bf16_matmul {m}x{k}x{n}")


@needs_kernel
@pytest.mark.parametrize("m,k,n", [(130, 577, 100), (40, 64, 1536), (40, 64, 200)])
def test_a_rows_bits_do_not_depend_on_its_batch(m: int, k: int, n: int) -> None:
    x, w = _operands(m, k, n, seed=1)
    call = jax.jit(native.bf16_matmul)
    full = np.asarray(call(x, w))
    # Every batch size from 1 to 9 (each tile shape and remainder block), a tall slice, and
    # the rows shuffled: the same row, the same bits.
    for rows in [*range(1, 10), 16, 17, 33]:
        np.testing.assert_array_equal(np.asarray(call(x[:rows], w)), full[:rows],
                                      err_msg=f"first {rows} rows")
    np.testing.assert_array_equal(np.asarray(call(x[-1:], w)), full[-1:])
    perm = np.random.default_rng(2).permutation(m)
    np.testing.assert_array_equal(np.asarray(call(x[perm], w)), full[perm])


@needs_kernel
@pytest.mark.parametrize("m,k", [(1, 576), (9, 37), (130, 64)])
def test_float32_rows_equal_rows_cast_to_bfloat16(m: int, k: int) -> None:
    """float32 x is rounded in the call as XLA's cast rounds it: the same bits out, for
    values at every rounding boundary and subnormals too (read as zero either way)."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((m, k), np.float32)
    # halfway cases of the bfloat16 rounding (ties to even both ways), and subnormals
    ties = (np.arange(x.size, dtype=np.uint32) % 4 + 0x3F808000).view(np.float32)
    x = np.where(rng.random((m, k)) < 0.3, ties.reshape(m, k), x)
    x[:, 0] = np.float32(1e-40)
    x = jnp.asarray(x)
    w = jnp.asarray(rng.standard_normal((k, 96), np.float32) * 0.05, jnp.bfloat16)
    call = jax.jit(native.bf16_matmul)
    np.testing.assert_array_equal(np.asarray(call(x, w)),
                                  np.asarray(call(x.astype(jnp.bfloat16), w)))


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 9])
def test_one_call_for_several_weights_equals_one_call_each(m: int) -> None:
    """A layer's q, k and v (or gate and up) in one call: the threads split all their
    columns together, and every output keeps the bits of its own call."""
    x, _ = _operands(m, 96, 1)
    rng = np.random.default_rng(5)
    ws = [jnp.asarray(rng.standard_normal((96, n), np.float32), jnp.bfloat16)
          for n in (96, 33, 32, 200)]
    grouped = jax.jit(native.bf16_matmuls)(x, ws)
    assert [g.shape for g in grouped] == [(m, w.shape[1]) for w in ws]
    for g, w in zip(grouped, ws, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(jax.jit(native.bf16_matmul)(x, w)))


@needs_kernel
def test_model_matmul_takes_the_kernel_on_cpu_only() -> None:
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((3, 1, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 32)), jnp.bfloat16)
    step = jax.jit(lambda x, w: matmul(x, w, NATIVE))
    assert native.BF16_MATMUL_TARGET in step.lower(x, w).as_text()
    cuda = step.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert native.BF16_MATMUL_TARGET not in cuda and "dot_general" in cuda
    # Same values as XLA's float32-accumulating dot, to float32 rounding.
    got, ref = step(x, w), matmul(x, w, True)
    assert got.shape == ref.shape == (3, 1, 32)
    x16 = np.abs(np.asarray(x.astype(jnp.bfloat16), np.float64))
    terms = x16 @ np.abs(np.asarray(w, np.float64))
    assert_close(got, ref, 2 * f32_tolerance(terms, 64), "NATIVE against XLA's dot")


def test_bad_operands_name_the_problem() -> None:
    with pytest.raises(ValueError, match="must be bfloat16 or float32"):
        native.bf16_matmul(jnp.ones((2, 4), jnp.float16), jnp.ones((4, 3), jnp.bfloat16))
    with pytest.raises(ValueError, match="w bfloat16"):
        native.bf16_matmul(jnp.ones((2, 4), jnp.float32), jnp.ones((4, 3), jnp.float32))
    with pytest.raises(ValueError, match="do not chain"):
        native.bf16_matmul(jnp.ones((2, 4), jnp.bfloat16), jnp.ones((5, 3), jnp.bfloat16))
    with pytest.raises(ValueError, match="1 to 4 weights"):
        native.bf16_matmuls(jnp.ones((2, 4), jnp.bfloat16), [jnp.ones((4, 3), jnp.bfloat16)] * 5)


# A tiny Llama whose weights have shapes no activation has; bfloat16, so on CPU every
# matmul goes through the kernel where the CPU has one.
TINY = ModelConfig(name="tiny-bf16", vocab_size=256, hidden_size=64, intermediate_size=160,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                   max_position_embeddings=256, eos_token_ids=(255,))


def test_servable_takes_the_kernel_where_there_is_one() -> None:
    model = random_servable(TINY, dtype="bfloat16", seed=3)
    assert model.acc32 == (NATIVE if HAVE_KERNEL else True)
    assert not random_servable(TINY, dtype="float32").acc32


@needs_kernel
def test_greedy_tokens_alone_equal_batched() -> None:
    """Batching changes M in every matmul (decode rows, a prefill chunk beside them); with
    the kernel each row's logits keep their bits, so greedy tokens cannot move."""
    model = random_servable(TINY, dtype="bfloat16", seed=3)
    engine = LLMEngine(model, SMALL)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(1, 250, size=n).tolist() for n in (5, 19, 11, 3, 26)]
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = run_alone(engine, prompts, sp)
    batched = [r.output_token_ids for r in run_jobs(engine, [(p, sp) for p in prompts])]
    assert batched == alone
    assert all(len(t) == 12 for t in alone)


@needs_kernel
@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads the CPU flags off Linux")
def test_amx_tiles_only_when_asked_for_on_a_cpu_that_has_them() -> None:
    """A process's matmuls take the AMX tiles with SUPERINFER_NATIVE_AMX=1 on an AMX-BF16
    CPU (Linux grants the tile state), the register tiles otherwise."""
    has_amx = {"amx_tile", "amx_bf16"} <= set(cpu_description()["cpu_flags"])
    asked = os.environ.get("SUPERINFER_NATIVE_AMX") == "1"
    assert native.matmul_tiles() == ("amx" if has_amx and asked else "avx512")
    probe = "from superinfer_jax.ops import native; print(native.matmul_tiles())"
    for value, expected in (("0", "avx512"), ("1", "amx" if has_amx else "avx512")):
        env = {**os.environ, "SUPERINFER_NATIVE_AMX": value}
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                             text=True, timeout=120, check=True).stdout.split()
        assert out[-1] == expected, f"SUPERINFER_NATIVE_AMX={value}"

