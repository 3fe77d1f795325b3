"""Tensor parallelism: one 1-D device mesh, and where the KV pool and step values live on it.

The engine shards over one mesh axis, ``tp``, of ``tensor_parallel_size`` devices, and lets
XLA's SPMD partitioner (``jax.jit`` over ``NamedSharding``) place the collectives. What is
sharded over ``tp``:

    device pool  [num_pages, num_layers, 2, page_size, kv_heads, head_dim]   on kv_heads
    host page    [num_layers, 2, page_size, kv_heads, head_dim]              on kv_heads
                  (memory kind pinned_host: each shard's slice sits in its host's memory)

Every device holds its heads' slice of every page, so rotation copies each slice on its
own device and moves no byte between devices; page ids, page tables and the scheduler
stay host-side and global. Model weights are sharded by the model family
(``models.sharding``). With ``tensor_parallel_size == 1`` the engine uses no mesh at all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

if TYPE_CHECKING:
    from superinfer_jax.model_api import ServableModel

TP_AXIS = "tp"

POOL_SPEC = P(None, None, None, None, TP_AXIS, None)
PAGE_SPEC = P(None, None, None, TP_AXIS, None)
# q / k / v / attention output [B, C, heads, head_dim]
HEADS_SPEC = P(None, None, TP_AXIS, None)
# fp8_e4m3's KV scales [num_layers, 2, kv_heads]: sharded with their heads
KV_SCALES_SPEC = P(None, None, TP_AXIS)


def make_mesh(tensor_parallel_size: int, devices: list[jax.Device] | None = None) -> Mesh:
    """A 1-D ``tp`` mesh over the first ``tensor_parallel_size`` devices (every host's,
    once ``jax.distributed.initialize`` has run). Axis type Auto: the partitioner chooses
    the collectives from the input shardings."""
    devices = list(jax.devices() if devices is None else devices)
    if tensor_parallel_size > len(devices):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} needs that many devices, found "
            f"{len(devices)} ({jax.default_backend()}); on CPU, set XLA_FLAGS="
            f"--xla_force_host_platform_device_count={tensor_parallel_size} before importing jax"
        )
    chosen = np.array(devices[:tensor_parallel_size])
    return Mesh(chosen, (TP_AXIS,), axis_types=(AxisType.Auto,))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def pool_sharding(mesh: Mesh, memory_kind: str | None = None) -> NamedSharding:
    """The device pool's sharding: each device holds its KV heads of every page."""
    return NamedSharding(mesh, POOL_SPEC, memory_kind=memory_kind)


def page_sharding(mesh: Mesh, memory_kind: str | None = None) -> NamedSharding:
    """One page's sharding (staging buffers and host pages): the pool's, minus page axis."""
    return NamedSharding(mesh, PAGE_SPEC, memory_kind=memory_kind)


def host_value(array: jax.Array) -> np.ndarray:
    """A replicated array's value on the host: this process's copy (across hosts it is
    not fully addressable, and every copy holds the same value)."""
    if array.is_fully_addressable:
        return np.asarray(array)
    return np.asarray(array.addressable_data(0))


def check_kv_heads(num_kv_heads: int, mesh: Mesh) -> None:
    """The pool splits whole KV heads: a model must present a multiple of the mesh size."""
    if num_kv_heads % mesh.size:
        raise ValueError(
            f"the model's KV pool has {num_kv_heads} KV heads, not a multiple of "
            f"tensor_parallel_size {mesh.size}: shard the model for this mesh first "
            "(models.sharding pads or replicates heads)"
        )


def place_model(model: ServableModel, mesh: Mesh | None) -> ServableModel:
    """``model`` on ``mesh``: as given when it already is (loaded with
    ``tensor_parallel_size``), else sharded now through its ``shard(mesh)``."""
    model_mesh: Mesh | None = getattr(model, "mesh", None)
    if model_mesh == mesh:
        if mesh is not None:
            check_kv_heads(model.kv_spec.num_kv_heads, mesh)
        return model
    if mesh is None:
        assert model_mesh is not None  # else the meshes would be equal (both None)
        raise ValueError(f"tensor_parallel_size is 1 but the model is sharded over "
                         f"{model_mesh.size} devices; set tensor_parallel_size to match")
    shard = getattr(model, "shard", None)
    if shard is None:
        raise ValueError(f"tensor_parallel_size={mesh.size}: this model cannot be "
                         "sharded (it has no shard(mesh))")
    model = shard(mesh)
    check_kv_heads(model.kv_spec.num_kv_heads, mesh)
    return model
