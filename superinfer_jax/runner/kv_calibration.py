"""fp8_e4m3's KV scales, calibrated once when the engine starts and fixed after.

One float32 prefill of a fixed text (``CALIBRATION_TEXT``, through the model's tokenizer)
writes every layer's K and V into a small float32 pool; the scale of each layer, K or V,
and KV head maps ``kv.quant.HEADROOM`` times the largest |value| there to the e4m3
maximum (``kv.quant.scales_from_amax``). The same weights on the same devices give the
same scales on every start, so pages, host copies and prefix-cache entries keep one
meaning.
Under TP the scales are sharded with their KV heads (``dist.parallel.KV_SCALES_SPEC``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from superinfer_jax.dist import parallel
from superinfer_jax.kv import quant
from superinfer_jax.kv.layout import PoolLayout
from superinfer_jax.model_api import ServableModel, StepInputs

CALIBRATION_TEXT = (
    "The capital of France is Paris. Water boils at one hundred degrees Celsius at sea "
    "level. def add(a, b):\n    return a + b\n\nQuestion: what is 17 times 23? Answer: "
    "391. In 1969 the first people walked on the Moon; they returned safely to Earth. "
    "Les chats dorment beaucoup. {\"name\": \"Ada\", \"year\": 1843} -- 3.14159, 2.71828!"
)
MAX_TOKENS = 128  # one short prefill: enough tokens to see each head's range
_MIN_TOKENS = 8  # a tokenizer giving fewer (a stub) is replaced by fixed random ids


def calibration_tokens(model: ServableModel, max_tokens: int) -> np.ndarray:
    """The calibration prompt's token ids (at most ``max_tokens``); fixed random ids
    (a seeded generator) for a model whose tokenizer cannot encode the text."""
    try:
        ids = list(model.tokenizer.encode(CALIBRATION_TEXT))
    except Exception:  # noqa: BLE001 - any tokenizer failure: fall back to fixed ids
        ids = []
    if len(ids) < _MIN_TOKENS or not all(0 <= t < model.vocab_size for t in ids):
        ids = np.random.default_rng(0).integers(0, model.vocab_size, MAX_TOKENS).tolist()
    return np.asarray(ids[:max_tokens], np.int32)


def calibrate_kv_scales(model: ServableModel, params, layout: PoolLayout,
                        max_model_len: int, mesh: Mesh | None) -> jax.Array:
    """The [L, 2, K] float32 scales of ``layout``'s model, placed with their heads."""
    tokens = calibration_tokens(model, min(MAX_TOKENS, max_model_len))
    n = len(tokens)
    pages = layout.pages_for_tokens(n)
    float_layout = dataclasses.replace(layout, dtype="float32")
    inputs = StepInputs.from_numpy(tokens[None], np.arange(n)[None], np.array([n]),
                                   np.array([n]), np.arange(1, pages + 1)[None])

    def amax(params, pool, inputs):
        _, pool = model.forward(params, pool, inputs, attention_backend="xla")[:2]
        return jnp.max(jnp.abs(pool[1:]), axis=(0, 3, 5))  # [L, 2, K]

    pool_sharding: jax.sharding.Sharding
    out_sharding: jax.sharding.Sharding
    scale_sharding: jax.sharding.Sharding
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        pool_sharding, out_sharding, scale_sharding = device, device, device
    else:
        pool_sharding = parallel.pool_sharding(mesh)
        out_sharding = parallel.replicated(mesh)
        scale_sharding = NamedSharding(mesh, parallel.KV_SCALES_SPEC)
    pool = jax.jit(lambda: float_layout.zeros(pages + 1), out_shardings=pool_sharding)()
    replicated_inputs = jax.device_put(inputs, out_sharding)
    found = jax.jit(amax, out_shardings=out_sharding)(params, pool, replicated_inputs)
    scales = quant.scales_from_amax(parallel.host_value(found))
    return jax.device_put(scales, scale_sharding)


def kv_scales_for(model: ServableModel, layout: PoolLayout, max_model_len: int,
                  mesh: Mesh | None) -> jax.Array | None:
    """The engine's KV scales: calibrated for a scaled dtype (fp8_e4m3), else None."""
    if not layout.scaled:
        return None
    return calibrate_kv_scales(model, model.params, layout, max_model_len, mesh)
