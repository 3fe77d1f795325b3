"""A self-contained mixture-of-experts FFN for ``benchmarks.moe``, in place of a Llama MLP.

Dropless top-k routing as the MoE models do it: the router in float32, softmax over the
chosen logits (Mixtral), the (token, expert) pairs sorted by expert, one
``ops.grouped_matmul`` per projection (SwiGLU experts stacked ``[experts, ...]``, gate and
up as one), and the pairs unsorted and combined by their router weights.
``MoEBlock.__call__`` has the signature of ``models.llama.MLP``, so ``moe_servable`` swaps
it into a random Llama and the engine's own forward (paged attention, native matmuls)
runs the step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.llama import Acc32, LlamaModel
from models.servable import LlamaServable
from superinfer_jax.ops.grouped_matmul import grouped_matmul


@dataclasses.dataclass(frozen=True)
class MoEShape:
    num_experts: int
    top_k: int
    expert_size: int  # each expert's intermediate size


class MoEBlock(nnx.Module):
    def __init__(self, hidden: int, shape: MoEShape, dtype, rngs: nnx.Rngs, impl: str = "auto",
                 probe: Callable[[jax.Array], None] | None = None):
        e, f = shape.num_experts, shape.expert_size

        def param(*dims: int) -> nnx.Param:
            return nnx.Param((0.02 * jax.random.normal(rngs.params(), dims)).astype(dtype))

        self.router = param(hidden, e)  # [hidden, experts]
        # gate and up side by side, [experts, hidden, 2 * expert]: one grouped matmul
        # (one pass over the routed experts, one thread hand-off) for both
        self.w_gate_up = param(e, hidden, 2 * f)
        self.w_down = param(e, f, hidden)  # [experts, expert, hidden]
        self.top_k, self.impl, self.probe = shape.top_k, impl, probe

    def __call__(self, x: jax.Array, acc32: Acc32 = False) -> jax.Array:
        lead, hidden = x.shape[:-1], x.shape[-1]
        tokens = x.reshape(-1, hidden)  # [T, hidden]
        k, num_experts = self.top_k, self.router.shape[1]
        logits = tokens.astype(jnp.float32) @ self.router[...].astype(jnp.float32)
        top, chosen = jax.lax.top_k(logits, k)  # [T, k]
        weights = jax.nn.softmax(top, axis=-1)
        order = jnp.argsort(chosen.reshape(-1), stable=True)  # pairs sorted by expert
        sizes = jnp.bincount(chosen.reshape(-1), length=num_experts).astype(jnp.int32)
        if self.probe is not None:
            jax.debug.callback(self.probe, sizes)
        wdtype = self.w_down.dtype
        out_dtype = jnp.float32 if acc32 else x.dtype
        xs = tokens[order // k].astype(wdtype)  # [T * k, hidden]

        def gmm(lhs: jax.Array, w: jax.Array) -> jax.Array:
            return grouped_matmul(lhs, w, sizes, preferred_element_type=out_dtype,
                                  impl=self.impl)

        gate, up = jnp.split(gmm(xs, self.w_gate_up[...]), 2, axis=-1)
        h = jax.nn.silu(gate) * up
        ys = gmm(h.astype(wdtype), self.w_down[...])  # [T * k, hidden], sorted
        unsorted = ys[jnp.argsort(order)].reshape(-1, k, hidden)  # [T, k, hidden]
        out = jnp.einsum("tkd,tk->td", unsorted.astype(jnp.float32), weights)
        return out.astype(out_dtype).reshape(*lead, hidden)


def moe_servable(config: ModelConfig, shape: MoEShape, dtype: str, seed: int = 0,
                 impl: str = "auto", probe: Callable[[jax.Array], None] | None = None
                 ) -> LlamaServable:
    """A random Llama of ``config`` whose every MLP is a ``MoEBlock`` of ``shape``."""
    rngs = nnx.Rngs(seed)
    module = LlamaModel(config, dtype=jnp.dtype(dtype), rngs=rngs)
    for layer in module.layers:
        layer.mlp = MoEBlock(config.hidden_size, shape, jnp.dtype(dtype), rngs, impl, probe)
    return LlamaServable(config, module, None, dtype)
