"""A loaded model: NNX weights split once, a tokenizer, and the engine's model interface.

A servable is either on one device (``mesh is None``) or tensor-parallel over a mesh
(``plan`` says how: ``models.sharding``). A sharded servable's module is built from the
plan's padded config, so ``kv_spec`` reports the KV heads the pool must hold; ``config``
stays the original architecture.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

import models.quant as quant
from models.config import ModelConfig
from models.expert_counts import ExpertCounts
from models.llama import NATIVE, Acc32, LlamaModel
from models.sharding import ParamPath, ShardPlan, fill_state, flat_state
from superinfer_jax.dist import parallel
from superinfer_jax.kv.layout import PoolLayout
from superinfer_jax.model_api import KVSpec, StepInputs
from superinfer_jax.ops import native

DTYPES = ("float32", "bfloat16")
COMPUTE_DTYPES = ("auto", "float32", "bfloat16")

log = logging.getLogger(__name__)


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return dtype


def resolve_compute(dtype: str, compute: str = "auto", platform: str | None = None
                    ) -> tuple[str, str]:
    """The dtype a model stored in ``dtype`` computes in on ``platform`` (default: JAX's
    default backend), and why.

    Only a bfloat16 checkpoint has a choice. On GPU and TPU it computes in bfloat16, the
    hardware's own type. On CPU (XLA:CPU, which has no bfloat16 arithmetic) "bfloat16"
    means bfloat16 matmul operands with float32 accumulation and float32 in between
    (``models.llama``), and "float32" means the weights upcast once at load, so every step
    streams twice the bytes through float32 matmuls. "auto" picks bfloat16 on CPU too:
    through the native kernel (``superinfer_jax.ops.native.bf16_matmul``) it decodes and
    prefills faster than float32 at every batch size measured (``docs/results/serving.md``).
    On a CPU without AVX512-BF16 the matmuls fall back to XLA's bfloat16 dot.
    """
    check_dtype(dtype)
    if compute not in COMPUTE_DTYPES:
        raise ValueError(f"compute dtype must be one of {COMPUTE_DTYPES}, got {compute!r}")
    platform = platform or jax.default_backend()
    if dtype == "float32":
        if compute == "bfloat16":
            raise ValueError("a float32 model cannot compute in bfloat16; load it as bfloat16")
        return "float32", "float32 weights"
    if compute != "auto":
        return compute, "asked for"
    if platform == "cpu":
        return "bfloat16", ("XLA:CPU's bfloat16 matmuls (float32 accumulation) read half the "
                            "bytes of float32 ones; elementwise work stays float32")
    return "bfloat16", f"{platform} computes in bfloat16 natively"


class LlamaServable:
    """Implements ``superinfer_jax.model_api.ServableModel`` for every decoder of
    ``models.llama`` (Llama family, Qwen3, Mixtral, Qwen3-MoE)."""

    # A draft head cut to some tokens (``models.draft.ranked_head``): the token id of each
    # logit column; None: the columns are the whole vocabulary.
    head_token_ids: np.ndarray | None = None

    def __init__(self, config: ModelConfig, module: LlamaModel, tokenizer: Any, dtype: str,
                 plan: ShardPlan | None = None, compute_dtype: str = "auto",
                 quantization: str = "none"):
        self.config = config
        self.tokenizer = tokenizer
        self.dtype = check_dtype(dtype)  # the weights as loaded (the checkpoint's dtype)
        self.plan = plan
        self.mesh: Mesh | None = plan.mesh if plan is not None else None
        self.graphdef, self.params = nnx.split(module)
        platform = jax.default_backend()
        self.compute_dtype, why = resolve_compute(dtype, compute_dtype, platform)
        # bfloat16 weights, float32 accumulation: XLA:CPU's bfloat16 path (models.llama),
        # through the native kernel where this CPU has one and the model is on one device
        # (a custom call has no sharding rule; under TP, XLA's dot).
        self.acc32: Acc32 = dtype == "bfloat16" and self.compute_dtype == "bfloat16" and \
            platform == "cpu"
        if self.acc32 and self.mesh is None and native.bf16_matmul_available():
            self.acc32 = NATIVE
        if dtype == "bfloat16" and self.compute_dtype == "float32" and \
                not quant.is_quantized(self.params):  # upcast once, here (quantized: done)
            self.params = jax.tree.map(lambda w: w.astype(jnp.float32), self.params)
        self.quantization = quant.check_mode(quantization)
        if quant.is_quantized(self.params) and quantization == "none":
            raise ValueError("the module holds quantized weights: pass their quantization")
        if quantization != "none":
            self._quantize(platform)
        if dtype == "bfloat16":
            how = ""
            if self.acc32:
                how = " matmuls, float32 accumulation, " + (
                    "native AVX512-BF16 kernel" if self.acc32 == NATIVE else "XLA's dot")
            log.info("%s: %s weights compute in %s%s (%s)", config.name, dtype,
                     self.compute_dtype, how, why)
        built = module.cfg  # the plan's padded config when sharded
        self.kv_spec = KVSpec(built.num_layers, built.num_kv_heads, built.head_dim)
        self.eos_token_ids = tuple(config.eos_token_ids)
        self.max_position_embeddings = config.max_position_embeddings
        self.vocab_size = config.vocab_size
        self._logits_fn = None
        # tokens per expert of every routed layer, added by each step (models.moe)
        self.expert_counts: ExpertCounts | None = None if config.moe is None else \
            ExpertCounts(config.moe_layers, config.moe.num_experts)

    def _quantize(self, platform: str) -> None:
        """Weights to ``self.quantization`` (``models.quant``): bfloat16 activations and
        float32 sums on CPU, through the native kernel on one device where it runs (its
        weights packed in the kernel's column panels, ``quant.pack_params``)."""
        if not quant.is_quantized(self.params):
            self.params = quant.quantize_params(self.params, self.quantization, self.plan)
        self.acc32 = platform == "cpu"
        if self.acc32 and self.mesh is None and native.quant_matmul_available():
            self.acc32 = NATIVE
            self.params = quant.pack_params(self.params, native.QUANT_PANEL,
                                            w8a8=native.w8a8_matmul_available())
        log.info("%s: %s weights, one scale per output channel%s", self.config.name,
                 self.quantization, " (native kernel)" if self.acc32 == NATIVE else "")

    def quantized(self, quantization: str) -> LlamaServable:
        """This model with its projections quantized (``models.quant``): ``none``, ``int8``
        or ``fp8``; sharded weights stay sharded (``models.sharding.scale_spec``)."""
        if quant.check_mode(quantization) == self.quantization:
            return self
        if self.quantization != "none":
            raise ValueError(f"weights are already {self.quantization}; load the model again")
        return LlamaServable(self.config, nnx.merge(self.graphdef, self.params),
                             self.tokenizer, self.dtype, self.plan, self.compute_dtype,
                             quantization)

    @property
    def name(self) -> str:
        return self.config.name

    def forward(self, params, kv_pool, inputs: StepInputs, *, attention_backend: str = "xla",
                all_logits: bool = False, return_hidden: bool = False, kv_scales=None):
        module = nnx.merge(self.graphdef, params)
        counts = None if self.expert_counts is None else self.expert_counts.add
        return module(kv_pool, inputs, backend=attention_backend, all_logits=all_logits,
                      mesh=self.mesh, return_hidden=return_hidden, acc32=self.acc32,
                      expert_counts=counts, kv_scales=kv_scales)

    def project(self, params, hidden):
        """Hidden states from ``forward(..., return_hidden=True)`` -> logits."""
        return nnx.merge(self.graphdef, params).project(hidden, self.mesh, self.acc32)

    def with_compute(self, compute_dtype: str) -> LlamaServable:
        """This model computing in ``compute_dtype`` (``resolve_compute``), same weights."""
        if compute_dtype == self.compute_dtype:
            return self
        if self.quantization != "none":
            raise ValueError("set the compute dtype before quantizing the weights")
        if self.dtype == "bfloat16" and self.compute_dtype == "float32":
            raise ValueError("the weights were upcast to float32 at load; load the model again")
        return LlamaServable(self.config, nnx.merge(self.graphdef, self.params),
                             self.tokenizer, self.dtype, self.plan, compute_dtype)

    def shard(self, mesh: Mesh) -> LlamaServable:
        """This model tensor-parallel over ``mesh``, converted tensor by tensor on device.

        For a model already loaded on one device; ``load_model(...,
        tensor_parallel_size=n)`` loads straight into the sharded layout instead."""
        if self.mesh is not None:
            if self.mesh == mesh:
                return self
            raise ValueError(f"model is already sharded over {self.mesh}; load it again")
        quant.check_one_device(self.quantization, mesh.size)
        plan = ShardPlan(self.config, mesh)
        graphdef, state = nnx.split(nnx.eval_shape(
            lambda: LlamaModel(plan.module_config, dtype=jnp.dtype(self.dtype))))
        on_device = all(d.process_index == jax.process_index() for d in mesh.devices.flat)
        fill_state(state, {path: _resharded(plan, path, w, on_device)
                           for path, w in flat_state(self.params).items()})
        return LlamaServable(self.config, nnx.merge(graphdef, state), self.tokenizer,
                             self.dtype, plan, self.compute_dtype, self.quantization)

    def logits(self, token_ids, page_size: int = 16, chunk_size: int | None = None,
               attention_backend: str = "xla") -> np.ndarray:
        """Full-sequence logits [T, vocab] through the paged path (one request, own pool)."""
        ids = np.asarray(token_ids, np.int32).reshape(-1)
        if ids.size == 0:
            raise ValueError("token_ids must not be empty")
        if ids.size > self.max_position_embeddings:
            raise ValueError(
                f"token_ids has {ids.size} tokens, over max_position_embeddings "
                f"{self.max_position_embeddings}"
            )
        # The pool in the dtype K and V are computed in (float32 on the CPU bfloat16 path).
        layout = PoolLayout(self.kv_spec, page_size,
                            "float32" if self.acc32 else self.compute_dtype)
        num_pages = layout.pages_for_tokens(ids.size)
        pool = layout.zeros(num_pages + 1)
        if self.mesh is not None:
            pool = jax.device_put(pool, parallel.pool_sharding(self.mesh))
        page_table = np.arange(1, num_pages + 1, dtype=np.int32)[None, :]
        chunk = chunk_size or ids.size
        if self._logits_fn is None:
            self._logits_fn = jax.jit(
                lambda p, pool, x, backend: self.forward(
                    p, pool, x, attention_backend=backend, all_logits=True),
                static_argnums=(3,), donate_argnums=(1,),
            )
        out = []
        for start in range(0, ids.size, chunk):
            piece = ids[start:start + chunk]
            n = piece.size
            inputs = StepInputs.from_numpy(
                tokens=piece[None, :],
                positions=np.arange(start, start + n)[None, :],
                query_lens=np.array([n]),
                context_lens=np.array([start + n]),
                page_tables=page_table,
            )
            logits, pool = self._logits_fn(self.params, pool, inputs, attention_backend)
            out.append(np.asarray(logits[0]))
        return np.concatenate(out, axis=0)

    def param_bytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self.params))


def _resharded(plan: ShardPlan, path: ParamPath, w: Any, on_device: bool) -> Any:
    """One one-device tensor in ``plan``'s layout: converted on device, or, across hosts,
    each process placing its own slices from the host. A quantized weight's ``q`` moves
    like the float weight and its scales with their columns."""
    if isinstance(w, quant.QuantizedWeight):
        w = w.row_major()  # sharded weights stay row-major
        if on_device:
            return dataclasses.replace(w, q=plan.reshard(path, w.q),
                                       scale=plan.reshard_scale(path, w.scale))
        return dataclasses.replace(w, q=plan.place(path, np.asarray(w.q), w.q.dtype),
                                   scale=plan.place_scale(path, np.asarray(w.scale)))
    if on_device:
        return plan.reshard(path, w)
    return plan.place(path, np.asarray(w), w.dtype)


def random_servable(config: ModelConfig, dtype: str = "float32", seed: int = 0,
                    tokenizer: Any = None, mesh: Mesh | None = None,
                    quantization: str = "none") -> LlamaServable:
    """A randomly initialised model, for tests and benchmarks that need no weights; the
    same seed gives the same weights with or without a ``mesh``."""
    module = LlamaModel(config, dtype=jnp.dtype(check_dtype(dtype)), rngs=nnx.Rngs(seed))
    servable = LlamaServable(config, module, tokenizer, dtype)
    servable = servable if mesh is None else servable.shard(mesh)
    return servable.quantized(quantization)
