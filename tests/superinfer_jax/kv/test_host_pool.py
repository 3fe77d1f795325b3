"""Host tier sizing, memory kinds and the config fields that drive them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from superinfer_jax.config import EngineConfig
from superinfer_jax.kv.host_pool import HostPool, host_memory_kind, num_host_pages_for


def test_sizing_from_pages_or_gib():
    assert num_host_pages_for(EngineConfig().duplex_kv.host_memory_gb, None, 1 << 20) == 0  # off
    assert num_host_pages_for(1.0, None, 1 << 20) == 1024
    assert num_host_pages_for(1.0, 7, 1 << 20) == 7


@pytest.mark.parametrize("field,value", [("num_host_pages", -1), ("num_host_pages", 2.5),
                                         ("host_memory_gb", -1.0), ("host_memory_gb", "4"),
                                         ("transfer_budget_pages", 0),
                                         ("eager_shadowing", 1)])
def test_bad_host_tier_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig.build(**{field: value})


def test_pages_live_in_pinned_host_memory_and_come_back_equal():
    device = jax.devices()[0]
    assert host_memory_kind(device) == "pinned_host"
    pool = HostPool(4, device)
    page = jnp.arange(24, dtype=jnp.bfloat16).reshape(2, 2, 3, 2)
    (host,) = jax.device_put([page], pool.host_sharding)
    pool.put([3], [host])
    assert host.sharding.memory_kind == "pinned_host"
    assert pool.holds(3, host) and pool.stored_pages() == {3}
    back = jax.device_put(pool.get([3])[0], pool.device_sharding)
    assert back.sharding.memory_kind == "device"
    assert (back == page).all()
    with pytest.raises(ValueError):
        pool.put([5], [host])
    pool.drop([3])
    assert pool.num_stored == 0
