"""``ParamSink``: the model's parameters collected leaf by leaf, as every loader streams
them, into an abstract (shape-only) model, so peak host memory stays near the size of
the final parameters."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

import models.quant as quant
from models.config import ModelConfig
from models.llama import LlamaModel
from models.servable import LlamaServable, check_dtype
from models.sharding import ShardPlan, fill_state, flat_state

ParamPath = tuple[str | int, ...]


def layer_path(layer: int, *names: str) -> ParamPath:
    """State path of a per-layer parameter, e.g. ``layer_path(3, "attn", "wq")``."""
    return ("layers", layer, *names)


class _OneKey:
    """Stands in for ``nnx.Rngs`` when only shapes are built: one key for every weight
    (``nnx.Rngs`` counts draws in graph state, which ``eval_shape`` pays for per weight)."""

    def params(self) -> jax.Array:
        return jax.random.key(0)


def abstract_model(config: ModelConfig, dtype: str) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's graph and a shape-only state: no weight memory is allocated."""
    module = nnx.eval_shape(lambda: LlamaModel(config, dtype=jnp.dtype(dtype),
                                               rngs=_OneKey()))  # type: ignore[arg-type]
    return nnx.split(module)


def _dotted(path: ParamPath) -> str:
    return ".".join(str(p) for p in path)


class ParamSink:
    """Collects parameters leaf by leaf into an abstract LlamaModel state.

    Each ``put`` checks the shape, casts to the target dtype and moves the array to the
    device (errors name the source file and tensor), so the caller can drop its host copy
    at once. With a ``mesh``, each tensor is converted to the sharded layout on the host
    (``models.sharding``) and every device receives only its own slice. With a
    ``quantization`` (``models.quant``), each projection is quantized as it arrives, so
    the float model is never whole in memory (sharded: ``q`` like the float weight,
    the scales with their columns).
    """

    def __init__(self, config: ModelConfig, dtype: str, mesh: Mesh | None = None,
                 quantization: str = "none"):
        self.config = config
        self.dtype = check_dtype(dtype)
        self.quantization = quant.check_mode(quantization)
        self.plan = ShardPlan(config, mesh) if mesh is not None else None
        built = self.plan.module_config if self.plan else config
        self.graphdef, self.state = abstract_model(built, dtype)
        targets = self.state if self.plan is None else abstract_model(config, dtype)[1]
        self._targets: dict[ParamPath, jax.ShapeDtypeStruct] = flat_state(targets)
        self._values: dict[ParamPath, jax.Array] = {}

    def put(self, path: ParamPath, array: Any, source: str) -> None:
        target = self._targets.get(path)
        if target is None:
            raise ValueError(f"{source}: model has no parameter {_dotted(path)}")
        if tuple(array.shape) != tuple(target.shape):
            raise ValueError(
                f"{source}: shape {tuple(array.shape)} does not match {_dotted(path)} "
                f"{tuple(target.shape)} of config {self.config.name!r}"
            )
        if self.plan is None:
            value = jnp.asarray(array, dtype=target.dtype)
        else:
            value = self.plan.place(path, array, target.dtype)
        self._values[path] = self._quantized(path, value)

    def put_quantized(self, path: ParamPath, values: Any, scales: Any, source: str) -> None:
        """A projection already quantized to ``self.quantization`` on the host: ``values``
        ``[..., in, out]`` (int8 or e4m3) and their per-output-channel ``scales``
        ``[..., out]``, placed as ``quantize`` would have placed them."""
        target = self._targets.get(path)
        if target is None:
            raise ValueError(f"{source}: model has no parameter {_dotted(path)}")
        want = jnp.dtype(quant.QDTYPES.get(self.quantization, jnp.float32))
        if tuple(values.shape) != tuple(target.shape) or values.dtype != want or \
                tuple(scales.shape) != tuple(target.shape[:-2]) + tuple(target.shape[-1:]):
            raise ValueError(
                f"{source}: {values.dtype} {tuple(values.shape)} with scales "
                f"{tuple(scales.shape)} do not match {_dotted(path)} {tuple(target.shape)} "
                f"as model.quantization {self.quantization}")
        if self.plan is None:
            self._values[path] = quant.QuantizedWeight(jnp.asarray(values), jnp.asarray(scales))
        else:
            self._values[path] = quant.QuantizedWeight(self.plan.place(path, values, values.dtype),
                                                       self.plan.place_scale(path, scales))

    def _quantized(self, path: ParamPath, value: jax.Array) -> Any:
        if self.quantization == "none" or not quant.quantized_path(path, value):
            return value
        return quant.quantize_placed(value, self.quantization,
                                     quant.plan_shardings(self.plan, path, value.ndim))

    def has(self, path: ParamPath) -> bool:
        return path in self._values

    def tie_lm_head(self) -> None:
        """Fill lm_head with embed.T (the model keeps its own [hidden, vocab] copy)."""
        embed = self._values[("embed",)]
        if self.plan is None:
            lm_head = jnp.asarray(embed.T)
        else:  # hidden-split -> vocab-split, device to device
            lm_head = jax.jit(
                jnp.transpose, out_shardings=self.plan.sharding(("lm_head",)))(embed)
        self._values[("lm_head",)] = self._quantized(("lm_head",), lm_head)

    def build(self, source: str) -> LlamaModel:
        missing = [_dotted(p) for p in self._targets if p not in self._values]
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise ValueError(f"{source}: missing {len(missing)} weight tensors: {shown}")
        fill_state(self.state, self._values)
        self._values = {}
        return nnx.merge(self.graphdef, self.state)

    def servable(self, source: str, tokenizer: Any) -> LlamaServable:
        """The built model as a servable (sharded when the sink has a mesh)."""
        return LlamaServable(self.config, self.build(source), tokenizer, self.dtype, self.plan,
                             quantization=self.quantization)
