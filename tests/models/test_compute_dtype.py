"""What a bfloat16 model computes in (models.servable.resolve_compute) and how.

On CPU a bfloat16 model's matmuls take bfloat16 operands and accumulate in float32; the
point is that XLA:CPU then reads each weight as stored instead of converting it to
float32 on every step, which is checked here on the compiled program itself.
"""

from __future__ import annotations

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import LlamaServable, ModelConfig, random_servable
from models.llama import matmul
from models.servable import resolve_compute
from superinfer_jax.kv.layout import PoolLayout
from superinfer_jax.model_api import StepInputs
from tests.numerics import assert_close, f32_tolerance

# hidden 64, FFN 96, vocab 320, 4 heads of 16 (2 KV heads): every weight has a 2-D shape
# no activation of a decode step with at most 8 rows has.
CONFIG = ModelConfig("tiny", 320, 64, 96, 2, 4, 2, 16, tie_word_embeddings=True)
PAGE = 8


def weight_shapes(config: ModelConfig) -> set[str]:
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {f"{a},{b}" for a, b in [(d, q), (d, kv), (q, d), (d, f), (f, d), (d, v)]}


def compiled_decode_step(model, rows: int) -> str:
    pages = 3
    table = np.arange(1, rows * pages + 1, dtype=np.int32).reshape(rows, pages)
    ctx = np.full(rows, 20, np.int32)
    inputs = StepInputs.from_numpy(np.ones((rows, 1)), (ctx - 1)[:, None], np.ones(rows),
                                   ctx, table)
    pool = PoolLayout(model.kv_spec, PAGE, "float32").zeros(rows * pages + 1)
    step = jax.jit(lambda p, kv, x: model.forward(p, kv, x))
    return step.lower(model.params, pool, inputs).compile().as_text()


def float32_weight_copies(hlo: str, config: ModelConfig) -> set[str]:
    """Weight shapes that appear in float32 in the compiled program (converted copies)."""
    return set(re.findall(r"f32\[(\d+,\d+)\]", hlo)) & weight_shapes(config)


@pytest.mark.parametrize("rows", [1, 8])
def test_cpu_bfloat16_step_reads_weights_as_stored(rows: int) -> None:
    model = random_servable(CONFIG, dtype="bfloat16")
    assert model.compute_dtype == "bfloat16" and model.acc32
    assert float32_weight_copies(compiled_decode_step(model, rows), CONFIG) == set()
    # What the check catches: a plain bfloat16 x bfloat16 dot, which XLA:CPU runs by
    # converting the weight to float32 first.
    model.acc32 = False
    assert float32_weight_copies(compiled_decode_step(model, rows), CONFIG)


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_matmul_accumulates_in_float32(rows: int) -> None:
    kx, kw = jax.random.split(jax.random.key(rows))
    x = jax.random.normal(kx, (rows, 1, 200), jnp.float32)
    w = jax.random.normal(kw, (200, 48), jnp.float32).astype(jnp.bfloat16)
    got = matmul(x, w, acc32=True)
    assert got.dtype == jnp.float32 and got.shape == (rows, 1, 48)
    # The operands rounded to bfloat16 (x by the matmul itself), then exact products
    # summed in float32: float32's bound for a 200-long sum, not bfloat16's.
    x16 = np.asarray(x.astype(jnp.bfloat16), np.float64)
    ref = x16 @ np.asarray(w, np.float64)
    terms = np.abs(x16) @ np.abs(np.asarray(w, np.float64))
    assert_close(got, ref, f32_tolerance(terms, 200), f"acc32 matmul, {rows} rows")


def test_float32_compute_is_the_float32_model_of_the_rounded_weights() -> None:
    stored = random_servable(CONFIG, dtype="bfloat16")
    upcast = stored.with_compute("float32")
    assert {str(w.dtype) for w in jax.tree.leaves(upcast.params)} == {"float32"}
    assert upcast.dtype == "bfloat16" and not upcast.acc32
    rounded = jax.tree.map(lambda w: w.astype(jnp.float32), stored.params)
    f32 = LlamaServable(CONFIG, nnx.merge(stored.graphdef, rounded), None, "float32")
    ids = list(range(3, 40))
    np.testing.assert_array_equal(upcast.logits(ids), f32.logits(ids))


def test_resolve_compute() -> None:
    assert resolve_compute("float32", "auto", "cpu")[0] == "float32"
    assert resolve_compute("bfloat16", "auto", "cpu")[0] == "bfloat16"
    assert resolve_compute("bfloat16", "auto", "gpu")[0] == "bfloat16"
    assert resolve_compute("bfloat16", "float32", "cpu") == ("float32", "asked for")
    with pytest.raises(ValueError, match="cannot compute in bfloat16"):
        resolve_compute("float32", "bfloat16", "cpu")
    with pytest.raises(ValueError, match="compute dtype must be one of"):
        resolve_compute("bfloat16", "float16", "cpu")


def test_choice_is_logged(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="models.servable"):
        random_servable(CONFIG, dtype="bfloat16")
    lines = [r.getMessage() for r in caplog.records if "compute in" in r.getMessage()]
    assert len(lines) == 1 and "bfloat16 weights compute in bfloat16" in lines[0]
