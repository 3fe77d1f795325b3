"""``superinfer serve``: wire a deployment config into running fronts and an engine.

Order matters for clients:
1. The fronts bind first (health NOT_SERVING, requests UNAVAILABLE "warming up"), so a
   probe sees a live process instead of a refused connection during the long warm-up.
2. The model loads and the engine compiles its buckets; then SERVING. With
   ``engine.compile_in_background`` (the default) SERVING comes once the smallest buckets
   are compiled: every request is served from then on, its calls kept within the buckets
   compiled so far while the rest compile behind (``superinfer_jax.runner.step_programs``).
3. SIGTERM (or Ctrl-C): DRAINING. Admission stops (health NOT_SERVING, UNAVAILABLE),
   in-flight requests finish for up to ``drain_grace_s``, the rest are aborted (their
   streams end with finish reason abort), the fronts close, the process exits 0.
   A signal during warm-up exits at once.

How the engine is built is an ``EngineFactory``: ``LocalEngine`` (load the model, build
an ``LLMEngine``) unless the caller passes another. Process 0 of a multi-host group
passes ``serving.group.LeaderEngine``, whose engine sends its device calls to the other
processes and whose ``close`` (after the drain) tells them to stop; the fronts, the
drain and the exit codes are the same either way.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import FrameType
from typing import Any, Protocol

from serving.deploy_config import DeploymentConfig
from serving.runtime import Runtime, ServerState

log = logging.getLogger("superinfer.serve")


def since_start() -> tuple[float, float]:
    """Wall-clock and CPU seconds since this process started (Linux: its start time in
    /proc, so the interpreter's start and every import count; elsewhere wall is NaN).
    Logged at each start-up milestone: on a shared machine the wall clock mostly says
    how busy the others were, the CPU time what start-up itself cost."""
    cpu = time.process_time()
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
        return uptime - started, cpu
    except (OSError, ValueError, IndexError):
        return float("nan"), cpu


class _Interrupted(Exception):
    """A stop signal arrived while the model was still loading or compiling."""


def _install_signals(stop: threading.Event, runtime: Runtime) -> None:
    def handler(signum: int, frame: FrameType | None) -> None:
        log.info("received %s", signal.Signals(signum).name)
        stop.set()
        if runtime.state is ServerState.WARMING_UP:
            raise _Interrupted

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _start_fronts(runtime: Runtime) -> list[Any]:
    fronts: list[Any] = []
    cfg = runtime.config.server
    try:
        if cfg.enable_grpc:
            from serving.grpc_server import GrpcFront

            fronts.append(GrpcFront(runtime).start())
        if cfg.enable_http:
            from serving.http_server import HttpFront

            fronts.append(HttpFront(runtime).start())
    except Exception:
        _stop_fronts(fronts)
        raise
    return fronts


def _stop_fronts(fronts: list[Any]) -> None:
    for front in fronts:
        front.stop()


class EngineFactory(Protocol):
    """Builds the server's engine once the fronts are up, and is closed after the drain
    (the engine thread has stopped by then: no device call follows ``close``)."""

    def build(self, config: DeploymentConfig) -> tuple[Any, Any]:
        """The warmed-up ``LLMEngine`` and the model it serves."""
        ...

    def close(self) -> None:
        ...


def load_model_of(config: DeploymentConfig) -> Any:
    """The deployment's model, split over ``model.tensor_parallel_size`` devices."""
    from models import load_model

    t0 = time.perf_counter()
    log.info("loading model %s (%s, weights quantization %s)", config.model.source,
             config.model.dtype, config.model.quantization)
    model = load_model(config.model.source, dtype=config.model.dtype,
                       tensor_parallel_size=config.engine.model.tensor_parallel_size,
                       weights_cache=config.engine.hardware.compilation_cache_dir,
                       quantization=config.model.quantization)
    with_chat_template(model, config)
    if not config.server.moe_expert_counts and getattr(model, "expert_counts", None) is not None:
        model.expert_counts = None  # no host callback in the step: its programs cache
    log.info("loaded in %.1f s; warming up (compiling step buckets)", time.perf_counter() - t0)
    return model


def load_draft_of(config: DeploymentConfig) -> Any:
    """The deployment's draft model (``speculative.method: draft``; ``models.draft``),
    in the target's dtype over the same devices; None for any other method."""
    from models.draft import load_draft

    spec = config.engine.speculative
    if spec.method != "draft":
        return None
    log.info("loading draft model %s (weights quantization %s, layers %s, head tokens %s)",
             spec.draft_model, spec.draft_quantization, spec.draft_layers or "all",
             spec.draft_vocab or "all")
    return load_draft(spec, config.model.dtype, config.engine.model.tensor_parallel_size,
                      config.engine.hardware.compilation_cache_dir)


def with_chat_template(model: Any, config: DeploymentConfig) -> Any:
    """``model`` with the deployment's chat template (``model.chat_template``), if set."""
    path = config.model.chat_template
    if path is not None and getattr(model, "tokenizer", None) is not None:
        from serving.tools import install_chat_template

        install_chat_template(model.tokenizer, path)
        log.info("chat template from %s", path)
    return model


class LocalEngine:
    """One process: load the model and build an ``LLMEngine`` (it warms up as built)."""

    def build(self, config: DeploymentConfig) -> tuple[Any, Any]:
        from superinfer_jax.engine import LLMEngine

        model = load_model_of(config)
        return LLMEngine(model, config.engine_config(), load_draft_of(config)), model

    def close(self) -> None:
        pass


def _build_engine(config: DeploymentConfig, runtime: Runtime,
                  factory: EngineFactory) -> tuple[Any, Any, Any]:
    from superinfer_jax.async_engine import AsyncEngine

    engine_config = config.engine_config()
    t0 = time.perf_counter()
    engine, model = factory.build(config)
    kv_events = _start_kv_events(config, engine)
    loop = AsyncEngine(engine, config.server.max_queue_len,
                       observers=[runtime.metrics.observe])
    log.info("ready in %.1f s: %s device pages of %d tokens", time.perf_counter() - t0,
             engine.stats().get("device_pages_total"), engine_config.hardware.page_size)
    return loop, model, kv_events


def _start_kv_events(config: DeploymentConfig, engine: Any) -> Any:
    """KV events (``serving.kv_events``) when ``server.kv_events_endpoint`` is set: the
    publisher (closed after the drain), else None."""
    server = config.server
    if server.kv_events_endpoint is None:
        return None
    from serving.kv_events import ZmqKVEventPublisher

    if not engine.config.prefix_caching.enabled:
        log.warning("server.kv_events_endpoint is set but prefix caching is off: no page "
                    "is ever cached, so no KV event will be published")
    publisher = ZmqKVEventPublisher(server.kv_events_endpoint, server.kv_events_topic,
                                    replay_endpoint=server.kv_events_replay_endpoint)
    engine.set_kv_event_sink(publisher.publish)
    log.info("publishing KV events on %s (topic %r)", server.kv_events_endpoint,
             server.kv_events_topic)
    return publisher


def serve(config: DeploymentConfig, factory: EngineFactory | None = None) -> int:
    """Run until a stop signal; returns the exit code (0 after a drain, 1 when the engine
    failed, so a supervisor restarts it). ``factory``: how the engine is built
    (default ``LocalEngine``)."""
    factory = factory or LocalEngine()
    runtime = Runtime(config)
    stop = threading.Event()
    fronts = _start_fronts(runtime)
    log.info("fronts listening %.1f s after the process started (%.1f s CPU)", *since_start())
    engine = kv_events = None
    code = 0
    try:
        _install_signals(stop, runtime)
        engine, model, kv_events = _build_engine(config, runtime, factory)
        runtime.set_serving(engine, model)
        log.info("serving %s: ready %.1f s after the process started (%.1f s CPU)",
                 runtime.served_name, *since_start())
        while not stop.wait(0.5):
            if engine.failure is not None:
                log.error("exiting: %s", engine.failure)
                code = 1
                break
    except _Interrupted:
        log.info("stopped during warm-up")
    finally:
        runtime.set_draining()
        if engine is not None:
            grace = config.server.drain_grace_s
            log.info("draining: %d requests in flight, grace %.0f s", engine.num_in_flight,
                     grace)
            clean = engine.drain(grace)
            log.info("drained" if clean else "grace period over: aborted the rest")
            engine.engine.stop_warmup()
        factory.close()
        runtime.set_stopped()
        _stop_fronts(fronts)
        if kv_events is not None:
            kv_events.close()
    log.info("bye")
    return code
