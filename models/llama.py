"""Flax NNX decoder over the paged KV pool: the Llama family, Qwen3 (per-head q/k norms)
and, with ``models.moe`` as the MLP of some layers, Mixtral and Qwen3-MoE.

Weights are stored in the layout the matmul wants (``x @ W`` with ``W[in, out]``) and the
output projection is kept as its own ``[hidden, vocab]`` matrix even when tied, because
XLA's CPU backend otherwise transposes the (large) embedding on every step. The KV pool is
passed in and returned, never held as module state.

How the forward computes from its weights is the caller's choice (``acc32``;
``models.servable`` picks it per platform). With ``acc32`` every matmul takes operands in
the weights' dtype and accumulates and returns float32, and everything between the
matmuls (residual stream, norms, RoPE, SiLU, K/V) stays float32: the bfloat16 path for
XLA:CPU, which has no bfloat16 arithmetic and would otherwise convert the whole weight
matrix to float32 on every step. Without it the step is ``x @ W`` in the weights' dtype.
``acc32 = NATIVE`` (one CPU device with AVX512-BF16) runs the same matmuls through the
native kernel (``superinfer_jax.ops.native.bf16_matmuls``), which streams the weights
faster than XLA's bfloat16 dot and keeps each row's bits whatever the batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import models.quant as quant
from models.config import ModelConfig
from models.moe import MoE
from superinfer_jax import ops
from superinfer_jax.dist.parallel import TP_AXIS
from superinfer_jax.model_api import StepInputs
from superinfer_jax.ops import native


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, scale: float = 0.02) -> nnx.Param:
    return nnx.Param((scale * jax.random.normal(rngs.params(), shape)).astype(dtype))


NATIVE = "native"
"""``acc32`` value: float32 accumulation through the native bfloat16 kernel on CPU."""

Acc32 = bool | str
"""How matmuls compute: ``False`` (``x @ W`` in the weights' dtype), ``True`` (operands in
the weights' dtype, float32 accumulation, XLA's dot) or ``NATIVE`` (the same through
``superinfer_jax.ops.native.bf16_matmul`` on CPU, XLA's dot on any other platform)."""


def _dot_acc32(x2: jax.Array, w: jax.Array) -> jax.Array:
    """XLA's dot, float32 accumulation. One row is padded to two, because XLA:CPU lowers a
    one-row bfloat16 dot as a matrix-vector product that first converts the whole weight
    to float32 (the batch-1 decode step), while two rows go to its bfloat16 matrix kernel,
    which reads the weight as it is stored."""
    rows = x2.shape[0]
    if rows == 1:
        x2 = jnp.pad(x2, ((0, 1), (0, 0)))
    return jnp.dot(x2, w, preferred_element_type=jnp.float32)[:rows]


def matmuls(x: jax.Array, ws: list[jax.Array], acc32: Acc32) -> list[jax.Array]:
    """``[x @ w for w in ws]`` for x [..., in], each w [in, out_i]: the weights that read
    the same activations (q, k and v; gate and up), in one native call under ``NATIVE``.

    ``acc32``: truthy for float32 accumulation and result. ``NATIVE`` sends every shape to
    the native kernel on CPU, never only some: its sums run in one fixed order per output,
    so a row's bits do not depend on how many rows share the step.

    Quantized weights (``models.quant.QuantizedWeight``) take ``models.quant.matmuls``:
    float32 results under ``acc32``, else the activations' dtype."""
    if isinstance(ws[0], quant.QuantizedWeight):
        outs = quant.matmuls(x, ws, native_cpu=acc32 == NATIVE)
        return outs if acc32 else [out.astype(x.dtype) for out in outs]
    if not acc32:
        return [x @ w for w in ws]
    lead, rows = x.shape[:-1], math.prod(x.shape[:-1])
    x2 = x.reshape(rows, x.shape[-1])
    if acc32 == NATIVE:  # the kernel rounds float32 rows to the weights' bfloat16 itself
        outs = jax.lax.platform_dependent(
            native.matmul_rows(x2), *ws, cpu=lambda x2, *ws: native.bf16_matmuls(x2, ws),
            default=lambda x2, *ws: [_dot_acc32(x2.astype(ws[0].dtype), w) for w in ws])
    else:
        outs = [_dot_acc32(x2.astype(ws[0].dtype), w) for w in ws]
    return [out.reshape(*lead, w.shape[-1]) for out, w in zip(outs, ws, strict=True)]


def matmul(x: jax.Array, w: jax.Array, acc32: Acc32) -> jax.Array:
    """``x @ w`` for x [..., in], w [in, out] (``matmuls`` with one weight)."""
    return matmuls(x, [w], acc32)[0]


def _gather_vocab(logits: jax.Array, mesh: Mesh) -> jax.Array:
    """Vocab-split logits [..., vocab] -> replicated, so sampling sees every token.

    Pinned split first: left free, the partitioner may all-gather lm_head (the weight,
    [hidden, vocab]) instead of the logits, which costs far more at serving batch sizes."""
    split = P(*([None] * (logits.ndim - 1)), TP_AXIS)
    logits = jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, split))
    return jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, P()))


ROW_SUM_LANES = 16


def row_sum(x: jax.Array) -> jax.Array:
    """``x.sum(-1, keepdims=True)`` in one fixed order whatever the leading shape: 16
    lane sums over the last axis in chunk order, then a fixed tree over the lanes, all
    elementwise adds. Why: XLA:CPU reduces a row in another order once a reduction has 8
    or more rows, so a row's bits (and near-tie argmaxes) would depend on its batch; the
    decode step must give a row the same bits in any batch (the speculative verify call
    scores its positions as decode rows of another count)."""
    n = x.shape[-1]
    pad = -n % ROW_SUM_LANES
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    chunks = x.reshape(*x.shape[:-1], -1, ROW_SUM_LANES)
    lanes = chunks[..., 0, :]
    for c in range(1, chunks.shape[-2]):
        lanes = lanes + chunks[..., c, :]
    while lanes.shape[-1] > 1:
        half = lanes.shape[-1] // 2
        lanes = lanes[..., :half] + lanes[..., half:]
    return lanes


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean_sq = row_sum(x32 * x32) * (1.0 / x32.shape[-1])
        x32 = x32 * jax.lax.rsqrt(mean_sq + self.eps)
        return (x32 * self.weight[...].astype(jnp.float32)).astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate-half RoPE. x: [B, C, H, D]; positions: [B, C]; inv_freq: [D // 2]."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, C, D/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        d, h, kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.wq = _param(rngs, (d, h * hd), dtype)  # [hidden, heads * head_dim]
        self.wk = _param(rngs, (d, kv * hd), dtype)  # [hidden, kv_heads * head_dim]
        self.wv = _param(rngs, (d, kv * hd), dtype)
        self.wo = _param(rngs, (h * hd, d), dtype)  # [heads * head_dim, hidden]
        if cfg.qkv_bias:
            self.bq = _param(rngs, (h * hd,), dtype)
            self.bk = _param(rngs, (kv * hd,), dtype)
            self.bv = _param(rngs, (kv * hd,), dtype)
        self.qkv_bias = cfg.qkv_bias
        if cfg.qk_norm:  # one [head_dim] weight, shared by every head
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype)
        self.qk_norm = cfg.qk_norm
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, hd

    def __call__(self, x, kv_pool, layer, inputs: StepInputs, inv_freq, backend,
                 mesh: Mesh | None = None, acc32: Acc32 = False, kv_scales=None):
        b, c, _ = x.shape
        q, k, v = matmuls(x, [self.wq[...], self.wk[...], self.wv[...]], acc32)
        if self.qkv_bias:
            q, k, v = q + self.bq[...], k + self.bk[...], v + self.bv[...]
        q = q.reshape(b, c, self.num_heads, self.head_dim)
        k = k.reshape(b, c, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, inputs.positions, inv_freq)
        k = apply_rope(k, inputs.positions, inv_freq)
        v = v.reshape(b, c, self.num_kv_heads, self.head_dim)
        out, kv_pool = ops.write_and_attend(
            q, k, v, kv_pool, layer, inputs.page_tables, inputs.positions, inputs.context_lens,
            inputs.query_lens, scale=self.head_dim**-0.5, backend=backend, mesh=mesh,
            kv_scales=kv_scales,
        )
        # Under TP, wo's rows are split like the heads: each shard's product is a partial
        # sum, and this matmul is where the partitioner places the block's first all-reduce.
        return matmul(out.reshape(b, c, -1), self.wo[...], acc32), kv_pool


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.w_gate = _param(rngs, (d, f), dtype)  # [hidden, ffn]
        self.w_up = _param(rngs, (d, f), dtype)  # [hidden, ffn]
        self.w_down = _param(rngs, (f, d), dtype)  # [ffn, hidden]

    def __call__(self, x, acc32: Acc32 = False):
        gate, up = matmuls(x, [self.w_gate[...], self.w_up[...]], acc32)
        return matmul(jax.nn.silu(gate) * up, self.w_down[...], acc32)


class DecoderLayer(nnx.Module):
    """Attention then an MLP, each pre-normed and residual; the MLP is routed experts
    (``models.moe``) in the layers the config's ``moe`` names."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, layer: int = 0):
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attn = Attention(cfg, dtype, rngs)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp: MLP | MoE = MoE(cfg, dtype, rngs) if cfg.is_moe_layer(layer) \
            else MLP(cfg, dtype, rngs)

    def __call__(self, x, kv_pool, layer, inputs, inv_freq, backend, mesh=None,
                 acc32: Acc32 = False, kv_scales=None):
        """Returns (x, kv_pool, per-expert token counts or None for a dense MLP)."""
        h, kv_pool = self.attn(self.attn_norm(x), kv_pool, layer, inputs, inv_freq, backend,
                               mesh, acc32, kv_scales)
        x = x + h
        if isinstance(self.mlp, MoE):
            valid = jnp.arange(x.shape[1])[None, :] < inputs.query_lens[:, None]
            out, counts = self.mlp(self.mlp_norm(x), valid, mesh, bool(acc32))
            return x + out, kv_pool, counts
        return x + self.mlp(self.mlp_norm(x), acc32), kv_pool, None


class LlamaModel(nnx.Module):
    """Decoder stack. ``__call__`` runs one paged step and returns (logits, kv_pool)."""

    def __init__(self, cfg: ModelConfig, dtype="float32", rngs: nnx.Rngs | None = None):
        rngs = rngs or nnx.Rngs(0)
        self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), dtype)  # [vocab, hidden]
        self.layers = nnx.List([DecoderLayer(cfg, dtype, rngs, i)
                                for i in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), dtype)  # [hidden, vocab]
        self.cfg = cfg

    def __call__(self, kv_pool, inputs: StepInputs, backend: str = "xla",
                 all_logits: bool = False, mesh: Mesh | None = None,
                 return_hidden: bool = False, acc32: Acc32 = False,
                 expert_counts: Callable[[jax.Array], None] | None = None, kv_scales=None):
        """With a ``mesh``, weights and the pool arrive sharded (``models.sharding``); the
        residual stream is kept replicated, so each block costs two all-reduces.
        ``acc32``: float32 accumulation and activations (module docstring).
        ``expert_counts``: a host function given, per step, the tokens each expert of
        each routed layer received ([moe layers, experts] int32, ``jax.debug.callback``).
        ``kv_scales``: an fp8_e4m3 pool's [L, 2, K] scales (``superinfer_jax.kv.quant``)."""
        x = self.embed[...][inputs.tokens]  # [B, C, hidden]
        if acc32:
            x = x.astype(jnp.float32)
        if mesh is not None:
            x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P()))
        inv_freq = jnp.asarray(self.cfg.inv_freq())  # constant, baked into the trace
        counts = []
        for layer_idx, layer in enumerate(self.layers):
            x, kv_pool, layer_counts = layer(x, kv_pool, layer_idx, inputs, inv_freq, backend,
                                             mesh, acc32, kv_scales)
            if layer_counts is not None:
                counts.append(layer_counts)
        if counts and expert_counts is not None:
            jax.debug.callback(expert_counts, jnp.stack(counts))
        if return_hidden:  # every column, normed: ``project`` maps them to logits
            hidden = self.final_norm(x)
            last = jnp.maximum(inputs.query_lens - 1, 0)
            x = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
            return self.project(x, mesh, acc32), kv_pool, hidden
        if not all_logits:
            last = jnp.maximum(inputs.query_lens - 1, 0)
            x = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]  # [B, hidden]
        return self.project(self.final_norm(x), mesh, acc32), kv_pool

    def project(self, x: jax.Array, mesh: Mesh | None = None,
                acc32: Acc32 = False) -> jax.Array:
        """Normed hidden states [..., hidden] -> float32 logits [..., vocab]."""
        logits = matmul(x, self.lm_head[...], acc32).astype(jnp.float32)
        if mesh is not None:
            logits = _gather_vocab(logits, mesh)
        return logits
