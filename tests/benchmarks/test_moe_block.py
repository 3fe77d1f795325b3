"""benchmarks.lib.moe_block, the MoE FFN ``benchmarks.moe`` times: equal to a plain numpy
MoE (each token's top-k experts by router logit, softmax over the chosen, SwiGLU experts,
weighted sum), so the benchmark times a correct layer. The benchmark itself (compiling
a dozen 4-layer steps) is not run here: ``python -m benchmarks.moe --quick``."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from benchmarks.lib.moe_block import MoEBlock, MoEShape
from tests.numerics import assert_close, f32_tolerance


def _numpy_moe(x: np.ndarray, block: MoEBlock, k: int) -> np.ndarray:
    router = np.asarray(block.router[...], np.float64)
    gate_up = np.asarray(block.w_gate_up[...], np.float64)
    down = np.asarray(block.w_down[...], np.float64)
    f = down.shape[1]
    out = np.zeros_like(x)
    for t, row in enumerate(x):
        logits = row @ router
        chosen = np.argsort(-logits, kind="stable")[:k]
        weights = np.exp(logits[chosen] - logits[chosen].max())
        weights /= weights.sum()
        for e, w in zip(chosen, weights, strict=True):
            gate, up = row @ gate_up[e, :, :f], row @ gate_up[e, :, f:]
            out[t] += w * ((gate / (1 + np.exp(-gate)) * up) @ down[e])
    return out


def test_moe_block_equals_a_plain_moe() -> None:
    shape = MoEShape(num_experts=6, top_k=2, expert_size=24)
    block = MoEBlock(32, shape, np.float32, nnx.Rngs(0))
    x = np.random.default_rng(1).standard_normal((3, 5, 32)).astype(np.float32)
    got = jax.jit(lambda x: block(x))(x)
    want = _numpy_moe(x.reshape(-1, 32).astype(np.float64), block, 2).reshape(x.shape)
    # Three chained sums (router, gate/up over hidden, down over the expert size) at the
    # scale of the output; a router near-tie could pick another expert, which random
    # normal inputs make vanishingly unlikely.
    assert_close(got, want, f32_tolerance(want, 32, depth=3),
                 "MoEBlock vs numpy")
