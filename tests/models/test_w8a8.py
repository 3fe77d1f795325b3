"""W8A8 (``model.quantization: w8a8_int8``): int8 weights times per-token int8 activations,
both rotated by a block Hadamard transform, summed exactly in int32.

The XLA form (``models.quant.w8a8_dot``) is the reference the native kernel
(``w8a8_matmul.cc``: AVX512-VNNI register tiles, AMX-INT8 from a few rows) must equal bit
for bit: every sum is exact, and the float32 steps around it are the same operations in
the same order. Against float64, the error is bounded by the two quantizations' steps."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import quant
from models.llama import NATIVE
from models.servable import random_servable
from superinfer_jax.ops import native
from tests.numerics import F32_EPS, assert_close
from tests.superinfer_jax.engine_testlib import TINY

REPO = Path(__file__).resolve().parents[2]
HAVE_KERNEL = native.w8a8_matmul_available()
needs_kernel = pytest.mark.skipif(
    not HAVE_KERNEL, reason="this CPU lacks AVX512-VNNI (or no C++ compiler): the XLA form "
                            "runs, as test_servable_packs_for_the_kernel_where_there_is_one "
                            "checks")
# (M, K, N, x's dtype): one row; a few rows on the register tiles; from 8 rows (AMX where
# the CPU has it) with row blocks of 16 and a remainder; K with Hadamard blocks 64 (576 =
# 9 x 64), 256 (1536), 4 (68: no whole 16-lane vector, so the plain stages) and 8; N with
# a tail block under 64 columns and a slice under 16.
SHAPES = [(1, 576, 576, jnp.float32), (3, 68, 100, jnp.bfloat16), (5, 24, 40, jnp.float32),
          (8, 1536, 200, jnp.bfloat16), (33, 128, 70, jnp.float32)]


def _weight(k: int, n: int, seed: int = 0) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32) * 0.05
    w[:, 0] = 0.0  # an all-zero column: scale 1
    return w


def _x(m: int, k: int, seed: int = 1, dtype=jnp.float32) -> jax.Array:
    x = np.random.default_rng(seed).standard_normal((m, k)).astype(np.float32)
    x[:, 3] *= 30.0  # an outlier channel, as normed activations have
    if m > 1:
        x[1] = 0.0  # an all-zero row: scale 1
    return jnp.asarray(x, dtype)


def _sylvester(b: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < b:
        h = np.block([[h, h], [h, -h]])
    return h


def test_rotation_block_is_the_largest_power_of_two_up_to_256() -> None:
    assert [quant.rotation_block(k) for k in (576, 1536, 68, 24, 7, 4096)] == \
        [64, 256, 4, 8, 1, 256]


@pytest.mark.parametrize("k", [576, 68, 24])
def test_hadamard_is_the_sylvester_matrix_block_by_block(k: int) -> None:
    """The butterfly equals x times block-diagonal H_b (float64), and twice is b times x."""
    b = quant.rotation_block(k)
    x = np.random.default_rng(0).standard_normal((3, k))
    dense = np.kron(np.eye(k // b), _sylvester(b))
    got = np.asarray(quant.hadamard(jnp.asarray(x, jnp.float32), b))
    # log2(b) stages of float32 adds, each value at most sqrt(b) times x's scale
    tol = 2 * np.log2(b) * F32_EPS * np.sqrt(b) * np.abs(x).max() * np.sqrt(b)
    assert np.abs(got - x @ dense).max() <= tol
    twice = np.asarray(quant.hadamard(quant.hadamard(jnp.asarray(x, jnp.float32), b), b))
    assert np.abs(twice / b - x).max() <= 2 * tol


def test_weights_are_stored_rotated_and_dequantize_back() -> None:
    """q * s is H w / b, quantized per column to half a step; ``dequantize`` undoes H."""
    w = _weight(576, 70)
    q = quant.quantize(jnp.asarray(w), quant.W8A8)
    assert q.w8a8 and q.mode == quant.W8A8 and q.q.dtype == jnp.int8
    rotated = _sylvester(64)[None] @ w.reshape(9, 64, 70) / 64
    scale = np.asarray(q.scale)
    step = np.abs(np.asarray(q.q, np.float64) * scale - rotated.reshape(576, 70))
    assert (step <= scale / 2 * (1 + 1e-5) + 1e-12).all()
    # undoing H sums 64 rotated errors of up to half a step each
    back = np.asarray(q.dequantize())
    assert np.abs(back - w).max() <= 64 * scale.max() / 2 * 1.01


def test_rows_quantize_to_127_steps_of_their_own_scale() -> None:
    x = _x(4, 576)
    q, s = quant.quantize_rows(x)
    rotated = np.asarray(x, np.float64).reshape(4, 9, 64) @ _sylvester(64)
    rotated = rotated.reshape(4, 576)
    amax = np.abs(rotated).max(axis=1, keepdims=True)
    np.testing.assert_allclose(np.asarray(s), np.where(amax > 0, amax / 127, 1), rtol=1e-5)
    assert np.abs(np.asarray(q)).max() == 127
    err = np.abs(np.asarray(q, np.float64) * np.asarray(s) - rotated)
    assert (err <= np.asarray(s) * (0.5 + 1e-4)).all()
    assert (np.asarray(q)[1] == 0).all()


def test_w8a8_is_within_its_quantization_bound_of_float64() -> None:
    """|x w - x_q s_x q s_w| is at most, per output, the sum over rotated k of
    |x'_k| dw + |w'_k| dx + dx dw (dx, dw half steps), plus float32 rounding."""
    k, n = 576, 70
    w, x = _weight(k, n), _x(5, k)
    q = quant.quantize(jnp.asarray(w), quant.W8A8)
    got = np.asarray(quant.w8a8_dot(x, q), np.float64)
    want = np.asarray(x, np.float64) @ w
    xr = (np.asarray(x, np.float64).reshape(5, 9, 64) @ _sylvester(64)).reshape(5, k)
    wr = (_sylvester(64)[None] @ w.reshape(9, 64, n) / 64).reshape(k, n)
    _, s_x = quant.quantize_rows(x)
    dx = np.asarray(s_x, np.float64) / 2  # [5, 1]
    dw = np.asarray(q.scale, np.float64)[None, :] / 2  # [1, n]
    bound = np.abs(xr).sum(1, keepdims=True) * dw + dx * np.abs(wr).sum(0)[None] + k * dx * dw
    bound += 8 * F32_EPS * np.abs(want).max()
    assert (np.abs(got - want) <= bound).all()
    # and the rotation earns its keep: without it the outlier channel sets every step
    assert np.abs(got - want).max() < 0.5 * bound.max()


def test_pack_w8a8_round_trips_with_a_tail_block() -> None:
    for k, n in [(8, 64), (12, 100), (576, 130), (4, 3)]:
        q = jnp.asarray(np.random.default_rng(k).integers(-127, 128, (k, n)), jnp.int8)
        packed = quant.pack_w8a8(q)
        assert packed.dtype == jnp.uint8 and packed.shape == (k, n)
        np.testing.assert_array_equal(np.asarray(quant.unpack_w8a8(packed)), np.asarray(q))
        # block 0, group 0: column j's four rows side by side, offset by 128
        width = min(64, n)
        np.testing.assert_array_equal(
            np.asarray(packed).reshape(-1)[:4 * width].reshape(width, 4),
            (np.asarray(q)[:4, :width].T.astype(np.int16) + 128).astype(np.uint8))


def _native(x: jax.Array, ws: list[quant.QuantizedWeight]) -> list[np.ndarray]:
    packed = [(quant.pack_w8a8(w.q), w.scale) for w in ws]
    outs = native.w8a8_matmuls(x, packed, rotation=quant.rotation_block(x.shape[1]))
    return [np.asarray(o) for o in outs]


@needs_kernel
@pytest.mark.parametrize("m,k,n,dtype", SHAPES)
def test_kernel_gives_the_reference_bits(m: int, k: int, n: int, dtype) -> None:
    ws = [quant.quantize(jnp.asarray(_weight(k, n, seed=s)), quant.W8A8) for s in (2, 3)]
    ws.append(quant.quantize(jnp.asarray(_weight(k, 16, seed=4)), quant.W8A8))
    x = _x(m, k, dtype=dtype)
    for got, w in zip(_native(x, ws), ws, strict=True):
        np.testing.assert_array_equal(got, np.asarray(quant.w8a8_dot(x, w)))


@needs_kernel
def test_a_rows_bits_do_not_depend_on_its_batch() -> None:
    w = quant.quantize(jnp.asarray(_weight(576, 200)), quant.W8A8)
    x = _x(40, 576)
    whole = _native(x, [w])[0]
    for rows in (1, 2, 7, 8, 16, 17, 33):  # register tiles and AMX row blocks
        np.testing.assert_array_equal(_native(x[:rows], [w])[0], whole[:rows])
    order = np.random.default_rng(0).permutation(40)
    np.testing.assert_array_equal(_native(x[order], [w])[0], whole[order])


_REGISTER_TILES = """
import hashlib, sys, numpy as np, jax.numpy as jnp
from models import quant
from superinfer_jax.ops import native
from tests.models.test_w8a8 import _native, _weight, _x
assert native.w8a8_tiles() in ("avx512", "amx"), native.w8a8_tiles()
w = quant.quantize(jnp.asarray(_weight(576, 200)), quant.W8A8)
print(native.w8a8_tiles(), hashlib.sha256(_native(_x(33, 576), [w])[0].tobytes()).hexdigest())
"""


@needs_kernel
def test_register_tiles_give_the_amx_bits() -> None:
    """``SUPERINFER_NATIVE_AMX=0`` keeps 33 rows on the AVX512-VNNI tiles; the default
    takes AMX-INT8 where the CPU has it: the same bytes either way."""
    hashes = {}
    for amx in ("0", "1"):
        env = {**os.environ, "SUPERINFER_NATIVE_AMX": amx, "JAX_PLATFORMS": "cpu",
               "PYTHONPATH": str(REPO)}
        done = subprocess.run([sys.executable, "-c", _REGISTER_TILES], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        tiles, digest = done.stdout.split()
        hashes[amx] = digest
        if amx == "0":
            assert tiles == "avx512"
    assert hashes["0"] == hashes["1"]


def test_bad_operands_name_the_problem() -> None:
    w = quant.quantize(jnp.ones((8, 3)), quant.W8A8)
    packed = quant.pack_w8a8(w.q)
    with pytest.raises(ValueError, match="rotation must be a power of two"):
        native.w8a8_matmuls(jnp.ones((2, 8)), [(packed, w.scale)], rotation=16)
    with pytest.raises(ValueError, match="w must be uint8"):
        native.w8a8_matmuls(jnp.ones((2, 8)), [(w.q, w.scale)])
    with pytest.raises(ValueError, match="K a multiple of 4"):
        native.w8a8_matmuls(jnp.ones((2, 6)), [(packed, w.scale)])
    with pytest.raises(ValueError, match="in-features must be a multiple of 4"):
        quant.pack_w8a8(jnp.ones((6, 3), jnp.int8))


def test_tensor_parallel_is_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match="model.quantization: w8a8_int8 runs on one device"):
        quant.check_one_device(quant.W8A8, 2)
    quant.check_one_device("int8", 2)


@pytest.fixture(scope="module")
def tiny_w8a8():
    return random_servable(TINY, seed=1, quantization=quant.W8A8)


def test_servable_packs_for_the_kernel_where_there_is_one(tiny_w8a8) -> None:
    weights = [w for w in jax.tree.leaves(tiny_w8a8.params,
                                          is_leaf=lambda x: isinstance(x, quant.QuantizedWeight))
               if isinstance(w, quant.QuantizedWeight)]
    assert len(weights) == 7 * TINY.num_layers + 1  # + lm_head
    assert all(w.mode == quant.W8A8 for w in weights)
    assert {w.panel for w in weights} == {native.W8A8_BLOCK if HAVE_KERNEL else 0}
    assert {w.q.dtype for w in weights} == {np.dtype(np.uint8 if HAVE_KERNEL else np.int8)}
    assert tiny_w8a8.acc32 == (NATIVE if native.quant_matmul_available() else True)


def test_native_logits_match_xla_logits(tiny_w8a8) -> None:
    """The same W8A8 model through the kernel and through XLA's int8 dot. The matmuls give
    equal bits (above), but XLA fuses the norms before them differently when the matmul is
    its own dot, so an activation may round one int8 step apart: the logits agree to one
    step of their own scale (1/127), and greedy tokens are the same."""
    xla = random_servable(TINY, seed=1, quantization="none").quantized(quant.W8A8)
    xla.params = jax.tree.map(
        lambda w: w.row_major() if isinstance(w, quant.QuantizedWeight) else w, xla.params,
        is_leaf=lambda x: isinstance(x, quant.QuantizedWeight))
    ids = np.arange(3, 40)
    got, ref = tiny_w8a8.logits(ids), xla.logits(ids)
    assert_close(got, ref, np.abs(ref).max() / 127, "native vs XLA W8A8 logits")
    np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))


def test_quantization_is_part_of_the_model_identity(tiny_w8a8) -> None:
    from superinfer_jax import EngineConfig
    from superinfer_jax.intake import model_identity

    assert model_identity(tiny_w8a8, EngineConfig.build()).endswith(":w8a8_int8")


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "serving.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def test_cli_generate_w8a8_says_paris() -> None:
    done = _cli("generate", "--quantization", "w8a8_int8", "--max-tokens", "8",
                "The capital of France is")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Paris" in done.stdout
