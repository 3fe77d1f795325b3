"""Weight quantization (``models.quant``, ``ops/native/quant_matmul.cc``): quantize and
dequantize against a plain numpy reference, the native int8 / fp8 kernel against a
float64 reference and batch-invariant, the XLA path where the kernel is off, the CUDA
form (an f8E4M3FN dot with its scales), column-packed weights (the kernel's storage:
the same bits as row-major), the servable on quantized weights, and the CLI's
answers to good and bad input (SmolLM2 int8 says Paris). Greedy tokens under batching,
rotation, recomputation and prefix hits with int8 weights: test_rotation_invariance."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import quant
from models.llama import NATIVE
from models.servable import random_servable
from superinfer_jax.ops import native
from tests.numerics import F32_EPS, assert_close, f32_tolerance, logits_tolerance
from tests.superinfer_jax.engine_testlib import TINY

REPO = Path(__file__).resolve().parents[2]
HAVE_KERNEL = native.bf16_matmul_available()
needs_kernel = pytest.mark.skipif(
    not HAVE_KERNEL, reason="this CPU lacks AVX512-BF16 (or no C++ compiler): XLA's dot "
                            "is used, as test_servable_takes_the_kernel_where_there_is_one checks")
MODES = ("int8", "fp8")
# One row (wide tiles), 2-3, 4-7, 8+ rows with remainder blocks; odd K; N not a multiple
# of 32; K long enough that a panel is narrower than the widest tile.
SHAPES = [(1, 576, 576), (1, 7, 33), (3, 577, 100), (5, 96, 200), (13, 1536, 64),
          (130, 64, 200)]


def _weight(k: int, n: int, seed: int = 0, lead: tuple[int, ...] = ()) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((*lead, k, n)).astype(np.float32) * 0.05
    w[..., :, 0] = 0.0  # an all-zero column: scale 1, not a division by zero
    return w


def _x(m: int, k: int, seed: int = 1) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal((m, k)), jnp.bfloat16)


@pytest.mark.parametrize("lead", [(), (3,)])  # a projection, and stacked experts
def test_int8_matches_numpy_reference(lead: tuple[int, ...]) -> None:
    w = _weight(40, 24, lead=lead)
    got = quant.quantize(jnp.asarray(w), "int8")
    amax = np.abs(w).max(axis=-2)
    scale = np.where(amax > 0, amax / 127, 1).astype(np.float32)
    assert got.q.dtype == jnp.int8 and got.scale.shape == (*lead, 24)
    np.testing.assert_allclose(np.asarray(got.scale), scale, rtol=F32_EPS)
    # Round to nearest of w / scale: off by one at most where float32 division rounds a
    # value at a half differently.
    expect = np.clip(np.round(w / scale[..., None, :]), -127, 127)
    assert np.abs(np.asarray(got.q, np.int32) - expect).max() <= 1
    deq = np.asarray(got.dequantize())
    assert np.all(np.abs(deq - w) <= scale[..., None, :] * (0.5 + 1e-5))
    assert np.all(np.asarray(got.q)[..., :, 0] == 0)


@pytest.mark.parametrize("lead", [(), (3,)])
def test_fp8_matches_numpy_reference(lead: tuple[int, ...]) -> None:
    w = _weight(40, 24, lead=lead)
    got = quant.quantize(jnp.asarray(w), "fp8")
    amax = np.abs(w).max(axis=-2)
    scale = np.where(amax > 0, amax / 448, 1).astype(np.float32)
    assert got.q.dtype == jnp.float8_e4m3fn
    np.testing.assert_allclose(np.asarray(got.scale), scale, rtol=F32_EPS)
    # e4m3 keeps 3 mantissa bits: half a unit is 2**-4 relative for normals, and 2**-10
    # of the scale in absolute terms for subnormals (spacing 2**-9 below 2**-6).
    deq = np.asarray(got.dequantize())
    bound = np.maximum(np.abs(w) * 2.0**-4, scale[..., None, :] * 2.0**-10) * (1 + 1e-5)
    assert np.all(np.abs(deq - w) <= bound)
    assert np.abs(np.asarray(got.q.astype(jnp.float32))).max() <= 448


def test_bad_mode_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"model.quantization must be one of none \| int8"):
        quant.check_mode("int4")
    with pytest.raises(ValueError, match="model.quantization"):
        random_servable(TINY, quantization="nf4")


def _reference(x: jax.Array, w: quant.QuantizedWeight) -> tuple[np.ndarray, np.ndarray]:
    """float64 (x @ q) * scale, and the magnitude of its terms."""
    x64 = np.asarray(x, np.float64)
    q64 = np.asarray(w.q.astype(jnp.float32), np.float64)
    s64 = np.asarray(w.scale, np.float64)
    return (x64 @ q64) * s64, (np.abs(x64) @ np.abs(q64)) * s64


def _bound(terms: np.ndarray, ref: np.ndarray, k: int) -> float:
    # bfloat16 x times a one-byte weight is exact in float32, so the error is float32's
    # sum of k terms, and one rounding of the product by the scale.
    return f32_tolerance(terms, k) + F32_EPS * float(np.abs(ref).max())


@needs_kernel
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_kernel_matches_float64_reference(mode: str, m: int, k: int, n: int) -> None:
    w = quant.quantize(jnp.asarray(_weight(k, n)), mode)
    x = _x(m, k)
    got = jax.jit(native.quant_matmuls)(x, [(w.q, w.scale)])[0]
    assert got.dtype == jnp.float32 and got.shape == (m, n)
    ref, terms = _reference(x, w)
    assert_close(got, ref, _bound(terms, ref, k), f"quant_matmul {mode} {m}x{k}x{n}")


@needs_kernel
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k,n", [(577, 100), (64, 600)])
def test_a_rows_bits_do_not_depend_on_its_batch(mode: str, k: int, n: int) -> None:
    w = quant.quantize(jnp.asarray(_weight(k, n, seed=3)), mode)
    x = _x(40, k, seed=4)
    call = jax.jit(native.quant_matmuls)
    full = np.asarray(call(x, [(w.q, w.scale)])[0])
    for rows in [*range(1, 10), 16, 17]:
        np.testing.assert_array_equal(np.asarray(call(x[:rows], [(w.q, w.scale)])[0]),
                                      full[:rows], err_msg=f"first {rows} rows")
    perm = np.random.default_rng(5).permutation(40)
    np.testing.assert_array_equal(np.asarray(call(x[perm], [(w.q, w.scale)])[0]), full[perm])


@needs_kernel
@pytest.mark.parametrize("mode", MODES)
def test_float32_rows_equal_rows_cast_to_bfloat16(mode: str) -> None:
    """float32 x is rounded to bfloat16 in the call, as XLA's cast rounds it."""
    w = quant.quantize(jnp.asarray(_weight(96, 70, seed=6)), mode)
    x = jnp.asarray(np.random.default_rng(7).standard_normal((9, 96), np.float32))
    call = jax.jit(native.quant_matmuls)
    np.testing.assert_array_equal(np.asarray(call(x, [(w.q, w.scale)])[0]),
                                  np.asarray(call(x.astype(jnp.bfloat16), [(w.q, w.scale)])[0]))


@needs_kernel
def test_one_call_for_several_weights_equals_one_call_each() -> None:
    x = _x(3, 96)
    ws = [quant.quantize(jnp.asarray(_weight(96, n, seed=n)), "int8") for n in (96, 33, 200)]
    grouped = jax.jit(native.quant_matmuls)(x, [(w.q, w.scale) for w in ws])
    for g, w in zip(grouped, ws, strict=True):
        one = jax.jit(native.quant_matmuls)(x, [(w.q, w.scale)])[0]
        np.testing.assert_array_equal(np.asarray(g), np.asarray(one))


@pytest.mark.parametrize("k,n,panel", [(5, 512, 256), (7, 576, 256), (3, 100, 256),
                                       (4, 96, 32), (6, 70, 64)])
def test_packed_columns_round_trip(k: int, n: int, panel: int) -> None:
    """Each panel is its own row-major block, end to end; the unpacking restores q."""
    q = jnp.asarray(np.arange(k * n).reshape(k, n) % 251 - 125, jnp.int8)
    packed = quant.pack_columns(q, panel)
    assert packed.shape == q.shape
    flat, at = np.asarray(packed).reshape(-1), 0
    for start in range(0, n, panel):
        block = np.asarray(q)[:, start:start + panel]
        np.testing.assert_array_equal(flat[at:at + block.size], block.reshape(-1))
        at += block.size
    np.testing.assert_array_equal(np.asarray(quant.unpack_columns(packed, panel)), np.asarray(q))
    w = quant.QuantizedWeight(packed, jnp.ones(n, jnp.float32), panel)
    np.testing.assert_array_equal(np.asarray(w.dequantize()), np.asarray(q, np.float32))


@needs_kernel
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("panel", [256, 64])
def test_packed_weights_give_the_row_major_bits(mode: str, panel: int) -> None:
    """The kernel on column-packed weights: the same bits as on row-major ones, for every
    tile shape (rows 1, 2-3, 4-7, 8+), partial panels and several weights per call."""
    call = jax.jit(native.quant_matmuls, static_argnames="panel")
    for m, k, n in SHAPES:
        w = quant.quantize(jnp.asarray(_weight(k, n)), mode)
        x = _x(m, k)
        want = np.asarray(call(x, [(w.q, w.scale)])[0])
        got = call(x, [(quant.pack_columns(w.q, panel), w.scale)], panel=panel)[0]
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"{m}x{k}x{n}")
    ws = [quant.quantize(jnp.asarray(_weight(96, n, seed=n)), mode) for n in (300, 33, 64)]
    x = _x(2, 96)
    want = call(x, [(w.q, w.scale) for w in ws])
    got = call(x, [(quant.pack_columns(w.q, panel), w.scale) for w in ws], panel=panel)
    for g, expect in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(expect))


def test_bad_kernel_operands_name_the_problem() -> None:
    w = quant.quantize(jnp.ones((4, 3)), "int8")
    with pytest.raises(ValueError, match="must be bfloat16 or float32"):
        native.quant_matmuls(jnp.ones((2, 4), jnp.float16), [(w.q, w.scale)])
    with pytest.raises(ValueError, match="do not chain"):
        native.quant_matmuls(jnp.ones((2, 5), jnp.bfloat16), [(w.q, w.scale)])
    f = quant.quantize(jnp.ones((4, 3)), "fp8")
    with pytest.raises(ValueError, match="share a dtype"):
        native.quant_matmuls(jnp.ones((2, 4), jnp.bfloat16), [(w.q, w.scale), (f.q, f.scale)])
    with pytest.raises(ValueError, match="panel must be 0 or a multiple of 32"):
        native.quant_matmuls(jnp.ones((2, 4), jnp.bfloat16), [(w.q, w.scale)], panel=48)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("native_cpu", [True, False])
def test_model_matmuls_match_the_reference(mode: str, native_cpu: bool) -> None:
    """``quant.matmuls`` through the kernel (where there is one) and through XLA's dot
    (the native-off path): both the float64 reference to float32 rounding."""
    w = quant.quantize(jnp.asarray(_weight(130, 70, seed=7)), mode)
    x = jnp.asarray(np.random.default_rng(8).standard_normal((2, 3, 130)), jnp.float32)
    step = jax.jit(lambda x, w: quant.matmuls(x, [w], native_cpu and HAVE_KERNEL)[0])
    text = step.lower(x, w).as_text()
    assert (native.QUANT_MATMUL_TARGET in text) == (native_cpu and HAVE_KERNEL)
    got = step(x, w)
    assert got.shape == (2, 3, 70)
    ref, terms = _reference(x.reshape(6, 130).astype(jnp.bfloat16), w)
    assert_close(got.reshape(6, 70), ref, 2 * _bound(terms, ref, 130), "quant.matmuls")


def test_cuda_form_is_an_fp8_dot_with_its_scales() -> None:
    """Lowered for CUDA, an fp8 projection is one f8E4M3FN x f8E4M3FN dot_general with
    float32 accumulation followed by the scales (XLA's FP8 GEMM pattern); int8 is a
    bfloat16 dot; neither calls the CPU kernel."""
    x = jnp.ones((4, 64), jnp.float32)
    for mode, operand in (("fp8", "f8E4M3FN"), ("int8", "bf16")):
        w = quant.quantize(jnp.asarray(_weight(64, 32)), mode)
        step = jax.jit(lambda x, w: quant.matmuls(x, [w], native_cpu=True)[0])
        cuda = step.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
        assert native.QUANT_MATMUL_TARGET not in cuda
        dots = re.findall(r"stablehlo\.dot_general.*", cuda)
        assert any(f"x{operand}>, tensor<64x32x{operand}>) -> tensor<4x32xf32>" in d
                   for d in dots), (mode, dots)
        assert "stablehlo.multiply" in cuda
    # The CUDA form's values: per-row e4m3 activations, so within e4m3's rounding of x.
    w = quant.quantize(jnp.asarray(_weight(64, 32)), "fp8")
    xr = jnp.asarray(np.random.default_rng(9).standard_normal((4, 64)), jnp.float32)
    ref, terms = _reference(xr, w)
    assert_close(quant.fp8_gemm(xr, w), ref, 2.0**-4 * float(terms.max()), "fp8_gemm")


def test_an_fp8_model_step_lowers_for_cuda_with_fp8_dots() -> None:
    """The whole decode step of an fp8 model, lowered for CUDA: every projection an f8
    dot (7 per layer and the head), and the CPU kernel nowhere."""
    from superinfer_jax.kv.layout import PoolLayout
    from superinfer_jax.model_api import StepInputs

    model = random_servable(TINY, seed=2, quantization="fp8")
    pool = PoolLayout(model.kv_spec, 8, "float32").zeros(5)
    inputs = StepInputs.from_numpy(tokens=np.ones((2, 1)), positions=np.zeros((2, 1)),
                                   query_lens=np.ones(2), context_lens=np.ones(2),
                                   page_tables=np.asarray([[1, 2], [3, 4]]))
    step = jax.jit(lambda p, pool, x: model.forward(p, pool, x))
    cuda = step.trace(model.params, pool, inputs).lower(lowering_platforms=("cuda",)).as_text()
    assert native.QUANT_MATMUL_TARGET not in cuda
    dots = re.findall(r"stablehlo\.dot_general.*", cuda)
    f8_dots = [d for d in dots if "xf8E4M3FN>, tensor<" in d]
    assert len(f8_dots) >= 7 * TINY.num_layers + 1


def test_grouped_experts_match_their_dequantized_weights() -> None:
    w = quant.quantize(jnp.asarray(_weight(32, 24, lead=(3,))), "int8")
    x = jnp.asarray(np.random.default_rng(10).standard_normal((7, 32)), jnp.float32)
    sizes = jnp.asarray([2, 0, 4])  # the last row belongs to no group: zeros
    got = np.asarray(quant.grouped_matmul(x, w, sizes))
    deq = np.asarray(w.dequantize(), np.float64)
    x64 = np.asarray(x.astype(jnp.bfloat16), np.float64)
    rows = [0, 0, 2, 2, 2, 2]
    ref = np.stack([x64[i] @ deq[g] for i, g in enumerate(rows)] + [np.zeros(24)])
    assert_close(got, ref, f32_tolerance(np.abs(x64) @ np.abs(deq).max(0), 32, k=16),
                 "grouped int8")


# -- the model ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_int8():
    return random_servable(TINY, seed=1, quantization="int8")


def test_servable_takes_the_kernel_where_there_is_one(tiny_int8) -> None:
    assert tiny_int8.acc32 == (NATIVE if HAVE_KERNEL else True)
    assert quant.is_quantized(tiny_int8.params)
    leaves = jax.tree.leaves(tiny_int8.params)
    assert sum(x.dtype == jnp.int8 for x in leaves) == 7 * TINY.num_layers + 1  # + lm_head
    weights = jax.tree.leaves(tiny_int8.params,
                              is_leaf=lambda x: isinstance(x, quant.QuantizedWeight))
    panels = {w.panel for w in weights if isinstance(w, quant.QuantizedWeight)}
    assert panels == {native.QUANT_PANEL if HAVE_KERNEL else 0}  # packed for the kernel
    with pytest.raises(ValueError, match="already int8"):
        tiny_int8.quantized("fp8")


def test_quantization_is_part_of_the_model_identity(tiny_int8) -> None:
    """Prefix-cache keys and the latency profile's path follow the weights' mode: a
    float model's pages or step prices never stand for an int8 model's."""
    from superinfer_jax import EngineConfig
    from superinfer_jax.intake import model_identity

    config = EngineConfig.build()
    plain = random_servable(TINY, seed=1, dtype=tiny_int8.dtype)
    assert model_identity(tiny_int8, config) != model_identity(plain, config)
    assert model_identity(tiny_int8, config).endswith(":int8")


def test_native_logits_equal_xla_logits_to_rounding(tiny_int8) -> None:
    """The same quantized model through the kernel and through XLA's dot: float32 sums
    in two orders, so within the model-sized float32 bound."""
    xla = random_servable(TINY, seed=1, quantization="int8")
    xla.acc32 = True  # XLA's dot, float32 sums: what the servable picks without the kernel
    ids = np.arange(3, 40)
    ref = xla.logits(ids)
    assert_close(tiny_int8.logits(ids), ref, logits_tolerance(TINY, ref, ids.size),
                 "native vs XLA int8 logits")


# -- loading and the CLI -----------------------------------------------------------------

def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "serving.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def test_cli_refuses_an_unknown_mode() -> None:
    done = _cli("generate", "--quantization", "int4", "hi")
    assert done.returncode == 2
    assert "model.quantization" in done.stderr and "Traceback" not in done.stderr


def test_a_block_type_that_does_not_map_is_refused(tmp_path: Path) -> None:
    """A Q4_K projection (nested super-block scales) under int8: one line naming the key
    and the tensor, exit 2, before anything loads."""
    path = tmp_path / "k_quant.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    kind = gguf.GGMLQuantizationType.Q4_K
    _, size = gguf.GGML_QUANT_SIZES[kind]  # bytes per block of 256 weights
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, size), np.uint8), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    done = _cli("generate", "--model", str(path), "--quantization", "int8", "hi")
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "model.quantization" in lines[0]
    assert "blk.0.attn_q.weight" in lines[0] and "Q4_K" in lines[0]
    assert "Traceback" not in done.stderr


def test_cli_generate_int8_says_paris() -> None:
    done = _cli("generate", "--quantization", "int8", "--max-tokens", "8",
                "The capital of France is")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Paris" in done.stdout
