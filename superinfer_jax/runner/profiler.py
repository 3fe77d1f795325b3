"""Measure this engine's latency model: the compiled step buckets on synthetic inputs.

Every page table points at the null page, so profiling allocates nothing and writes only
to the scratch page, while attention still reads (and pays for) the requested context.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Generator

import jax
import numpy as np

from superinfer_jax.config import EngineConfig
from superinfer_jax.kv.layout import NULL_PAGE
from superinfer_jax.model_api import StepInputs
from superinfer_jax.runner.sampling import SamplingInputs
from superinfer_jax.sched.latency import LatencyModel


def _time_step(engine, rows: int, cols: int, query_len: int, context: int,
               repeats: int) -> float:
    cfg = engine.config
    positions = np.broadcast_to(np.arange(context - query_len, context - query_len + cols),
                                (rows, cols))
    inputs = StepInputs.from_numpy(
        tokens=np.ones((rows, cols)), positions=np.maximum(positions, 0),
        query_lens=np.full(rows, query_len), context_lens=np.full(rows, context),
        page_tables=np.full((rows, cfg.max_pages_per_seq), NULL_PAGE))
    sampling = SamplingInputs.greedy(rows)
    best = float("inf")
    for _ in range(repeats + 1):  # the first run is a warm-up
        t = time.perf_counter()
        engine.call_step(inputs, sampling).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return best


def _time_transfer(engine, num_pages: int, repeats: int) -> float:
    # A device of this process: across hosts the pool's device set includes other
    # processes' devices, which this one cannot copy to.
    device = engine.kv_pool.addressable_shards[0].device
    try:
        host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    except (ValueError, RuntimeError):
        host = jax.sharding.SingleDeviceSharding(device)
    data = engine.layout.zeros(num_pages)
    best = float("inf")
    for _ in range(repeats + 1):
        t = time.perf_counter()
        jax.device_put(data, host).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return best


def profile_engine(engine, repeats: int = 2) -> LatencyModel:
    """Fit prefill / decode / transfer costs from the engine's own compiled buckets
    (``engine``: an ``LLMEngine`` or its ``ModelRunner``, which owns the buckets)."""
    pieces = profile_pieces(engine, repeats)
    while True:
        try:
            next(pieces)
        except StopIteration as done:
            return done.value


def profile_pieces(engine, repeats: int = 2) -> Generator[None, None, LatencyModel]:
    """``profile_engine`` one measurement at a time: each ``next`` times one shape (a
    fraction of a second), so an idle server can profile between requests; the
    generator returns the fitted model."""
    engine = getattr(engine, "runner", engine)
    cfg = engine.config
    max_ctx = cfg.model.max_model_len - 1
    contexts = sorted({min(c, max_ctx) for c in (16, max_ctx // 4, max_ctx)})
    decode = []
    for b in cfg.decode_buckets[::2] + cfg.decode_buckets[-1:]:
        for c in contexts:
            decode.append((b, b * c, _time_step(engine, b, 1, 1, c, repeats)))
            yield
    prefill = []
    for chunk in cfg.prefill_chunk_buckets:
        for ctx in sorted({chunk, min(max_ctx, chunk + max_ctx // 2)}):
            s = _time_step(engine, 1, chunk, chunk, ctx, repeats)
            prefill.append((chunk, ctx - chunk, s))
            yield
    transfer = [(n * engine.layout.page_bytes, _time_transfer(engine, n, repeats))
                for n in (1, 8, 32)]
    return LatencyModel.fit(prefill, decode, transfer,
                            model_name=getattr(engine.model, "name", ""))


def latency_profile_path(config: EngineConfig, model_identity: str) -> str | None:
    """Where the latency model is kept: ``rotasched.latency_profile``, else in the
    compilation cache directory under a key of what the timings depend on (model
    shapes, buckets, backend, device and CPU count), else nowhere."""
    if config.rotasched.latency_profile:
        return config.rotasched.latency_profile
    cache = config.hardware.compilation_cache_dir
    if not cache:
        return None
    device = jax.devices()[0]
    facts = (model_identity, config.model.max_model_len, config.decode_buckets,
             config.prefill_shapes, config.hardware.attention_backend,
             config.model.tensor_parallel_size,
             device.platform, device.device_kind, os.cpu_count(), jax.__version__)
    key = hashlib.sha256(repr(facts).encode()).hexdigest()[:16]
    return os.path.join(cache, f"latency-profile-{key}.json")


def load_latency_model(path: str | None) -> LatencyModel | None:
    """The latency model saved at ``path``, if there is one."""
    if path and os.path.exists(path):
        return LatencyModel.load(path)
    return None


def save_latency_model(model: LatencyModel, path: str | None) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        model.save(path)
