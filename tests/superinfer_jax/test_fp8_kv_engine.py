"""fp8 KV pages in the engine (and bfloat16 pages, stored like fp8's in an integer
stand-in on CPU): greedy tokens within the mode never change under rotation,
recomputation, prefix hits (either tier) and batching; the pool sized by bytes holds
twice bf16's pages; oversized pools, unknown dtypes and fp8 on a pre-fp8 GPU's Pallas
path fail at start with an error naming the key.

Within the mode: the reference is the same fp8 engine running each request alone, so a
difference is the engine's (a page moved wrong, a scale that changed), not fp8 rounding.
"""

from __future__ import annotations

import types

import jax
import numpy as np
import pytest

from serving.cli import main
from superinfer_jax import EngineConfig, LLMEngine, SamplingParams
from superinfer_jax.config import ModelLayout
from superinfer_jax.config_schema import ConfigError
from superinfer_jax.kv import quant
from superinfer_jax.kv.layout import PoolLayout
from superinfer_jax.runner import device_pool
from tests.superinfer_jax.engine_testlib import SMALL, TINY, run_alone, run_rotating


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(0, 250, size=int(n)).tolist() for n in rng.integers(3, 30, 6)]


SP = SamplingParams(max_tokens=12, ignore_eos=True)


def test_e4m3_tokens_equal_under_prefix_hits_batching_and_rotation(tiny, prompts):
    # 11 usable pages: one request needs up to 6, the batch about 25
    engine = LLMEngine(tiny, SMALL.replace(num_device_pages=12, num_host_pages=64,
                                           dtype="fp8_e4m3"))
    # the fp8 bytes; on CPU in their integer stand-in (``kv.quant.CPU_STORAGE``)
    assert engine.kv_pool.dtype == engine.layout.storage == jax.numpy.uint8
    scales = np.asarray(engine.runner.kv_scales)
    assert scales.shape == (TINY.num_layers, 2, TINY.num_kv_heads) and (scales > 0).all()
    reference = run_alone(engine, prompts, SP)
    # again: the last prompts' full pages are still cached on the device
    assert run_alone(engine, prompts[-2:], SP) == reference[-2:]
    assert engine.stats()["prefix_cache_hits"] > 0
    done = run_rotating(engine, prompts, SP, every=3)
    assert [r.output_token_ids for r in done] == reference
    stats = engine.stats()
    assert sum(r.num_rotations for r in done) >= 3 and stats["transfer_rotations_in"] >= 3
    assert stats["prefix_cache_host_hits"] > 0  # prefix pages that came back from the host
    np.testing.assert_array_equal(np.asarray(engine.runner.kv_scales), scales)  # fixed
    # RotaSched prices a transfer by the fp8 page: half a bfloat16 page's bytes
    half = PoolLayout(engine.layout.kv_spec, 8, "bfloat16").page_bytes // 2
    assert engine.scheduler.page_bytes == engine.layout.page_bytes == half


# bfloat16 too: on CPU it is stored in its uint16 stand-in, written and read as fp8's are
@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2", "bfloat16"])
def test_fp8_tokens_equal_under_recomputation(tiny, prompts, dtype):
    engine = LLMEngine(tiny, SMALL.replace(num_device_pages=10, dtype=dtype))
    assert engine.duplex is None
    assert engine.kv_pool.dtype == quant.storage_dtype(dtype)
    assert (engine.runner.kv_scales is None) == (dtype != "fp8_e4m3")  # only e4m3 scales
    reference = run_alone(engine, prompts[:4], SP)
    done = run_rotating(engine, prompts[:4], SP, every=2)
    assert [r.output_token_ids for r in done] == reference
    assert sum(r.num_preemptions for r in done) >= 2


# -- sizing and bad input (no model step) --------------------------------------------------

def _layout(dtype: str, page_size: int = 16) -> PoolLayout:
    from superinfer_jax.model_api import KVSpec

    return PoolLayout(KVSpec(30, 3, 64), page_size, dtype)  # SmolLM2-135M's KV


@pytest.mark.parametrize("gb", [0.05, 0.3])
def test_byte_budget_gives_fp8_twice_bf16_pages(gb):
    config = EngineConfig.build(kv_cache_memory_gb=gb, max_model_len=256)
    pages = {d: device_pool.choose_num_pages(config, _layout(d))
             for d in ("float32", "bfloat16", "fp8_e4m3", "fp8_e5m2")}
    for dtype, n in pages.items():  # the whole budget, scales counted, and no more
        layout = _layout(dtype)
        used = n * layout.page_bytes + layout.scale_bytes
        assert used <= gb * 2**30 < used + layout.page_bytes, dtype
    assert abs(pages["fp8_e4m3"] - 2 * pages["bfloat16"]) <= 1
    assert abs(pages["fp8_e5m2"] - 2 * pages["bfloat16"]) <= 1
    assert abs(pages["bfloat16"] - 2 * pages["float32"]) <= 1


def test_budget_below_one_request_names_the_key():
    config = EngineConfig.build(kv_cache_memory_gb=0.001, max_model_len=2048)
    with pytest.raises(ConfigError) as err:
        device_pool.choose_num_pages(config, _layout("bfloat16"))
    assert err.value.key == "hardware.kv_cache_memory_gb"


@pytest.mark.parametrize(("fields", "key"), [
    ({"kv_cache_memory_gb": 1 << 20}, "hardware.kv_cache_memory_gb"),
    ({"num_device_pages": 1 << 40}, "hardware.num_device_pages"),
    ({"host_memory_gb": 1 << 20}, "duplex_kv.host_memory_gb"),
    ({"num_host_pages": 1 << 40}, "duplex_kv.num_host_pages"),
])
def test_pools_beyond_available_memory_fail_at_start_naming_the_key(fields, key):
    config = EngineConfig.build(max_model_len=256, **fields)
    layout = _layout("fp8_e4m3")
    device = device_pool.choose_num_pages(config, layout)
    host = fields.get("num_host_pages", int(fields.get("host_memory_gb", 0) * 2**30)
                      // layout.page_bytes)
    with pytest.raises(ConfigError) as err:
        device_pool.check_pools_fit(config, layout, device, host)
    assert err.value.key == key and "available" in str(err.value)
    device_pool.check_pools_fit(config, layout, 64, 64)  # small pools fit


def test_unknown_kv_dtype_names_the_key(capsys):
    with pytest.raises(ConfigError) as err:
        ModelLayout(kv_cache_dtype="fp8")
    assert err.value.key == "model.kv_cache_dtype"
    assert main(["generate", "--set", "model.kv_cache_dtype=int4", "hi"]) == 2
    assert "model.kv_cache_dtype" in capsys.readouterr().err


def test_fp8_pallas_on_a_gpu_without_fp8_names_the_key(monkeypatch):
    old_gpu = types.SimpleNamespace(compute_capability="8.0")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "local_devices", lambda: [old_gpu])
    config = EngineConfig.build(dtype="fp8_e4m3")
    with pytest.raises(ConfigError) as err:
        device_pool.check_backend_dtype(config, "pallas")
    assert err.value.key == "model.kv_cache_dtype" and "8.0" in str(err.value)
    assert "\n" not in str(err.value)
    device_pool.check_backend_dtype(config, "xla")  # XLA's path converts anywhere
    device_pool.check_backend_dtype(EngineConfig.build(dtype="bfloat16"), "pallas")
    monkeypatch.setattr(jax, "local_devices",
                        lambda: [types.SimpleNamespace(compute_capability="9.0")])
    device_pool.check_backend_dtype(config, "pallas")  # Hopper has fp8


def test_cache_config_info_reports_the_pages_the_byte_budget_gave(tiny):
    from prometheus_client.parser import text_string_to_metric_families

    from serving.metrics import ServingMetrics

    budget_gb = 64 * 2048 / 2**30  # 64 bfloat16 pages of the tiny model, 128 fp8 ones
    pages = {}
    for dtype in ("bfloat16", "fp8_e5m2"):
        engine = LLMEngine(tiny, SMALL.replace(kv_cache_memory_gb=budget_gb, dtype=dtype))
        metrics = ServingMetrics("m")
        metrics.set_cache_config(8, dtype)
        metrics.observe([], engine.stats())
        (info,) = [s for f in text_string_to_metric_families(metrics.render().decode())
                   for s in f.samples if s.name == "vllm:cache_config_info"]
        assert info.labels["cache_dtype"] == dtype
        pages[dtype] = int(info.labels["num_gpu_blocks"])
        assert pages[dtype] == engine.num_device_pages - 1  # the null page holds nothing
    assert engine.layout.page_bytes == 1024 and pages == {"bfloat16": 63, "fp8_e5m2": 127}
