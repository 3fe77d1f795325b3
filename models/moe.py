"""Mixture-of-experts MLP: a float32 router, dropless top-k routing, grouped matmuls.

Each token picks ``top_k`` experts. The (token, expert) pairs are sorted by expert, so
every expert's rows are contiguous, and each projection is one grouped matmul over the
stacked expert weights (``superinfer_jax.ops.grouped_matmul``, ``jax.lax.ragged_dot``'s
contract): no dense loop over the experts and no capacity limit, so no token is dropped.
The rows are unsorted and each token's outputs summed with its routing weights.

Weights (``[in, out]`` per expert, stacked on a leading expert axis)::

    router   [hidden, experts]        computed in float32
    we_gate  [experts, hidden, ffn]   we_up the same
    we_down  [experts, ffn, hidden]

Expert parallelism (with a mesh): the experts are split over the tensor-parallel axis,
``experts / tp`` whole experts per device; the activations and the routing are
replicated (every device routes every token), each device runs its own experts' rows
(the others sort past its groups and come back as zeros) and the per-device partial sums
are added with one ``psum``, the same single all-reduce a dense Megatron MLP costs.
Quantized experts (``models.quant``) split the same way, each expert's scales with it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import models.quant as quant
from models.config import ModelConfig
from models.sharding import EXPERT_SCALE_SPEC, EXPERT_SPEC
from superinfer_jax.dist.parallel import TP_AXIS
from superinfer_jax.ops.grouped_matmul import grouped_matmul


def route(logits: jax.Array, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """Router logits [T, E] (float32) -> (weights [T, k] float32, experts [T, k] int32):
    softmax over all experts, the ``top_k`` largest kept, renormalised if asked."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def experts_forward(x: jax.Array, weights: jax.Array, experts: jax.Array, we_gate: jax.Array,
                    we_up: jax.Array, we_down: jax.Array, first: jax.Array | int,
                    acc32: bool) -> jax.Array:
    """The routed SwiGLU of the experts ``first .. first + len(we_gate)`` (all of them on
    one device, one shard's under expert parallelism): x [T, hidden] -> float32 [T,
    hidden], summed over each token's chosen experts among these, weighted."""
    num_local = we_gate.shape[0]
    t, k = experts.shape
    local = experts.reshape(-1) - first  # [T * k]
    mine = (local >= 0) & (local < num_local)
    key = jnp.where(mine, local, num_local)  # another device's pairs sort last
    order = jnp.argsort(key, stable=True)
    sizes = jnp.zeros((num_local + 1,), jnp.int32).at[key].add(1)[:num_local]
    compute = _compute_dtype(we_gate)
    rows = x[order // k].astype(compute)  # [T * k, hidden], grouped by expert
    out_type = jnp.float32 if acc32 else None
    gate = _expert_matmul(rows, we_gate, sizes, out_type)
    up = _expert_matmul(rows, we_up, sizes, out_type)
    hidden = (jax.nn.silu(gate) * up).astype(compute)
    y = _expert_matmul(hidden, we_down, sizes, out_type)
    y = y[jnp.argsort(order)].reshape(t, k, -1).astype(jnp.float32)  # unsorted
    return jnp.sum(y * weights[..., None], axis=1)


def _compute_dtype(w) -> jnp.dtype:
    """Stacked experts' compute dtype: bfloat16 for quantized experts (W8A16)."""
    return jnp.dtype(jnp.bfloat16) if isinstance(w, quant.QuantizedWeight) else w.dtype


def _expert_matmul(rows: jax.Array, w, sizes: jax.Array, out_type) -> jax.Array:
    """``grouped_matmul`` of float or quantized (``models.quant``) stacked experts."""
    if isinstance(w, quant.QuantizedWeight):
        out = quant.grouped_matmul(rows, w, sizes)  # float32, scaled per group and column
        return out if out_type is not None else out.astype(rows.dtype)
    return grouped_matmul(rows, w, sizes, preferred_element_type=out_type)


def _init(rngs: nnx.Rngs, shape: tuple[int, ...], dtype) -> nnx.Param:
    return nnx.Param((0.02 * jax.random.normal(rngs.params(), shape)).astype(dtype))


class MoE(nnx.Module):
    """A routed-experts MLP (module docstring). ``__call__`` returns the output and the
    number of valid tokens routed to each expert ([experts] int32)."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        moe = cfg.moe
        assert moe is not None
        d, f, e = cfg.hidden_size, moe.intermediate_size, moe.num_experts
        self.router = _init(rngs, (d, e), dtype)  # [hidden, experts]
        self.we_gate = _init(rngs, (e, d, f), dtype)  # [experts, hidden, ffn]
        self.we_up = _init(rngs, (e, d, f), dtype)
        self.we_down = _init(rngs, (e, f, d), dtype)  # [experts, ffn, hidden]
        self.top_k, self.normalize, self.num_experts = moe.top_k, moe.norm_topk_prob, e

    def __call__(self, x: jax.Array, valid: jax.Array, mesh: Mesh | None = None,
                 acc32: bool = False) -> tuple[jax.Array, jax.Array]:
        """x [B, C, hidden]; valid [B, C] bool (padding is computed but not counted)."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        logits = x2.astype(jnp.float32) @ self.router[...].astype(jnp.float32)
        weights, experts = route(logits, self.top_k, self.normalize)
        counts = jnp.zeros((self.num_experts,), jnp.int32).at[experts].add(
            valid.reshape(-1, 1).astype(jnp.int32))
        ws = (self.we_gate[...], self.we_up[...], self.we_down[...])
        if mesh is None:
            out = experts_forward(x2, weights, experts, *ws, 0, bool(acc32))
        else:
            out = _expert_parallel(x2, weights, experts, ws, mesh, bool(acc32))
        return out.astype(x.dtype).reshape(*lead, -1), counts


def _expert_parallel(x2, weights, experts, ws, mesh: Mesh, acc32: bool) -> jax.Array:
    """``experts_forward`` with the experts split over the mesh, partial sums psum-ed."""
    num_local = ws[0].shape[0] // mesh.shape[TP_AXIS]

    def local(x2, weights, experts, we_gate, we_up, we_down):
        first = jax.lax.axis_index(TP_AXIS) * num_local
        out = experts_forward(x2, weights, experts, we_gate, we_up, we_down, first, acc32)
        return jax.lax.psum(out, TP_AXIS)

    rep = P()
    specs = tuple(quant.QuantizedWeight(EXPERT_SPEC, EXPERT_SCALE_SPEC)  # type: ignore[arg-type]
                  if isinstance(w, quant.QuantizedWeight) else EXPERT_SPEC for w in ws)
    return jax.shard_map(local, mesh=mesh, in_specs=(rep, rep, rep, *specs),
                         out_specs=rep, check_vma=False)(x2, weights, experts, *ws)
