"""Prometheus metrics, vLLM-style names under a ``superinfer:`` prefix, plus the ``vllm:``
gauges the inference gateway's endpoint picker scrapes (GIE's model-server protocol).

Latency histograms and counters are fed by an engine-loop observer (``observe``): it runs
on the engine thread right after each step, so token times are the engine's own, not the
moment a front got round to sending them. Gauges (running, waiting, rotary, cache usage)
and the bytes-moved counters come from the latest stats snapshot at scrape time, through
a custom collector: they are the engine's numbers (``EngineStats``), read when asked for.

The ``vllm:`` gauges mean what vLLM's mean: ``num_requests_waiting`` / ``running`` are the
scheduler's queues; ``kv_cache_usage_perc`` is the device tier's used fraction (0..1),
where cached pages no request references count as free (reclaimed on demand, as in vLLM);
``gpu_cache_usage_perc`` is the same under its pre-v1 name, which GIE's model-server
protocol still lists; ``cache_config_info`` is an info gauge (value 1) whose labels are
the page size (``block_size``), the device page count (``num_gpu_blocks``: what
``hardware.kv_cache_memory_gb`` gave, for its KV dtype) and the KV dtype (``cache_dtype``),
once the engine exists.

A mixture-of-experts model adds ``superinfer:moe_expert_tokens_total``: tokens routed to
each expert, per group of consecutive routed layers (labels ``layers``, e.g. "0-11", and
``expert``), read from the model's counts at scrape time (``models.expert_counts``), so
load imbalance across experts is visible.

Each server owns its registry, so two servers in one process (tests) never collide.
Preemptions and rotations are counted when their request finishes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from serving.requests import RequestSummary
from serving.stats_view import read
from superinfer_jax.engine import RequestOutput
from superinfer_jax.stats import EngineStats

PREFIX = "superinfer:"
VLLM_PREFIX = "vllm:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0)


class _SnapshotCollector(Collector):
    """Gauges and engine-side counters, read from the latest stats at scrape time."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stats: dict[str, Any] = {}
        self.block_size: int | None = None  # the page size, once the engine exists
        # MoE models: {layer group: tokens per expert}, read at scrape time
        self.expert_counts: Callable[[], Mapping[str, Any]] | None = None
        self.cache_dtype = ""  # the KV dtype (model.kv_cache_dtype), once the engine exists

    def collect(self) -> Iterator[Any]:
        view = read(self.stats)
        labels = ["model_name"]
        yield from self._vllm(view, labels)
        if self.expert_counts is not None:
            yield self._experts(labels)
        for name, value, doc in (
            ("num_requests_running", view.num_running, "Requests decoding or prefilling."),
            ("num_requests_waiting", view.num_waiting, "Requests queued for admission."),
            ("num_requests_rotary", view.num_rotary, "Requests parked in host memory."),
        ):
            g = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            g.add_metric([self.model_name], value)
            yield g
        usage = GaugeMetricFamily(PREFIX + "kv_cache_usage_perc",
                                  "Fraction of KV pages in use, per memory tier (0..1).",
                                  labels=[*labels, "tier"])
        for tier in ("device", "host"):
            usage.add_metric([self.model_name, tier], view.usage(tier))
        yield usage
        for name, tier_values, doc in (
            ("kv_pages_total", (("device", view.device_pages_total),
                                ("host", view.host_pages_total)), "KV pages, per memory tier."),
            ("kv_pages_used", (("device", view.device_pages_total - view.device_pages_free),
                               ("host", view.host_pages_total - view.host_pages_free)),
             "KV pages in use (device: cached unreferenced pages count as free)."),
        ):
            g = GaugeMetricFamily(PREFIX + name, doc, labels=[*labels, "tier"])
            for tier, value in tier_values:
                g.add_metric([self.model_name, tier], value)
            yield g
        cache = view.prefix_cache
        cached = GaugeMetricFamily(PREFIX + "prefix_cache_pages",
                                   "Cached pages no request references (reclaimable), per "
                                   "tier.", labels=[*labels, "tier"])
        cached.add_metric([self.model_name, "device"], 0 if cache is None else cache.cached_pages)
        cached.add_metric([self.model_name, "host"],
                          0 if cache is None else cache.host_cached_pages)
        yield cached
        moved = CounterMetricFamily(PREFIX + "kv_bytes_moved",
                                    "KV bytes copied between tiers, by direction.",
                                    labels=[*labels, "direction"])
        moved.add_metric([self.model_name, "to_host"], view.bytes_to_host)
        moved.add_metric([self.model_name, "to_device"], view.bytes_to_device)
        yield moved
        # prompt tokens looked up at admission, and found, per tier: the host tier is
        # asked for what the device did not have
        for name, device, host, doc in (
            ("prefix_cache_queries", view.prefix_cache_queries,
             0 if cache is None else cache.host_queries,
             "Prompt tokens looked up in the prefix cache, per tier."),
            ("prefix_cache_hits", view.prefix_cache_hits,
             0 if cache is None else cache.host_hits,
             "Prompt tokens found in the prefix cache, per tier."),
        ):
            c = CounterMetricFamily(PREFIX + name, doc, labels=[*labels, "tier"])
            c.add_metric([self.model_name, "device"], device)
            c.add_metric([self.model_name, "host"], host)
            yield c

    def _experts(self, labels: list[str]) -> CounterMetricFamily:
        assert self.expert_counts is not None
        family = CounterMetricFamily(PREFIX + "moe_expert_tokens",
                                     "Tokens routed to each expert, summed over a group of "
                                     "consecutive routed layers.",
                                     labels=[*labels, "layers", "expert"])
        for group, counts in self.expert_counts().items():
            for expert, n in enumerate(counts):
                family.add_metric([self.model_name, group, str(expert)], int(n))
        return family

    def _vllm(self, view: EngineStats, labels: list[str]) -> Iterator[Any]:
        """vLLM's names and units: what the gateway's endpoint picker reads."""
        for name, value, doc in (
            ("num_requests_running", view.num_running,
             "Number of requests in model execution batches."),
            ("num_requests_waiting", view.num_waiting,
             "Number of requests waiting to be processed."),
            ("kv_cache_usage_perc", view.usage("device"),
             "KV-cache usage. 1 means 100 percent usage."),
            # its name before vLLM v1 (GIE's model-server protocol still lists it)
            ("gpu_cache_usage_perc", view.usage("device"),
             "GPU KV-cache usage (vllm:kv_cache_usage_perc's former name)."),
        ):
            g = GaugeMetricFamily(VLLM_PREFIX + name, doc, labels=labels)
            g.add_metric([self.model_name], value)
            yield g
        cache = view.prefix_cache
        if cache is not None:  # vLLM's counters: the device tier, then its KV connector's
            for name, value, doc in (
                ("prefix_cache_queries", cache.queries,
                 "Prefix cache queries, in terms of number of queried tokens."),
                ("prefix_cache_hits", cache.hits,
                 "Prefix cache hits, in terms of number of cached tokens."),
                ("external_prefix_cache_queries", cache.host_queries,
                 "External prefix cache queries from KV connector cross-instance cache "
                 "sharing, in terms of number of queried tokens (here: the host tier)."),
                ("external_prefix_cache_hits", cache.host_hits,
                 "External prefix cache hits from KV connector cross-instance cache "
                 "sharing, in terms of number of cached tokens (here: the host tier)."),
            ):
                c = CounterMetricFamily(VLLM_PREFIX + name, doc, labels=labels)
                c.add_metric([self.model_name], value)
                yield c
        yield from _spec_decode(view, self.model_name, labels)
        if self.block_size is not None:
            info = GaugeMetricFamily(VLLM_PREFIX + "cache_config_info",
                                     "Information of the LLMEngine CacheConfig.",
                                     labels=[*labels, "block_size", "num_gpu_blocks",
                                             "cache_dtype"])
            info.add_metric([self.model_name, str(self.block_size),
                             str(view.device_pages_total), self.cache_dtype], 1)
            yield info


class ServingMetrics:
    def __init__(self, model_name: str):
        disable_created_metrics()  # no *_created series: noise for every dashboard
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._snapshot = _SnapshotCollector(model_name)
        self.registry.register(self._snapshot)
        m = ["model_name"]
        r = self.registry
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Arrival to first token.", m, buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Time between consecutive tokens.", m, buckets=_ITL_BUCKETS,
                             registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "Arrival to completion.", m, buckets=_E2E_BUCKETS, registry=r)
        self.preemptions = Counter(PREFIX + "num_preemptions",
                                   "Evictions with recomputation.", m, registry=r)
        self.rotations = Counter(PREFIX + "num_rotations",
                                 "KV rotations out to host memory.", m, registry=r)
        self.slo_attained = Counter(PREFIX + "slo_attained", "Requests within their SLO.",
                                    [*m, "kind"], registry=r)
        self.slo_violated = Counter(PREFIX + "slo_violated", "Requests over their SLO.",
                                    [*m, "kind"], registry=r)
        self.request_success = Counter(PREFIX + "request_success", "Finished requests.",
                                       [*m, "finished_reason"], registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prefilled prompt tokens.", m,
                                     registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", m,
                                         registry=r)
        for counter in (self.preemptions, self.rotations, self.prompt_tokens,
                        self.generation_tokens):
            counter.labels(model_name)  # every series exists from the first scrape
        for kind in ("ttft", "tbt"):
            self.slo_attained.labels(model_name, kind)
            self.slo_violated.labels(model_name, kind)

    def set_cache_config(self, block_size: int, cache_dtype: str = "") -> None:
        """The engine's page size and KV dtype (``vllm:cache_config_info``); set once it
        exists."""
        self._snapshot.block_size = block_size
        self._snapshot.cache_dtype = cache_dtype

    def set_expert_counts(self, source: Callable[[], Mapping[str, Any]]) -> None:
        """A MoE model's per-expert token counts by layer group
        (``models.expert_counts.ExpertCounts.by_group``)."""
        self._snapshot.expert_counts = source

    def observe(self, outputs: list[RequestOutput], stats: dict[str, Any]) -> None:
        """Engine-loop observer: one call per step."""
        self._snapshot.stats = stats
        name = self.model_name
        for out in outputs:
            times = out.request.token_times
            if out.new_token_ids:
                self.generation_tokens.labels(name).inc(len(out.new_token_ids))
                if len(times) == 1:
                    self.ttft.labels(name).observe(times[0] - out.request.arrival_time)
                elif len(times) >= 2:
                    self.itl.labels(name).observe(times[-1] - times[-2])
            if out.finished:
                self._finished(out)

    def _finished(self, out: RequestOutput) -> None:
        name, req = self.model_name, out.request
        s = RequestSummary.from_request(req)
        self.e2e.labels(name).observe(s.e2e_ms / 1000)
        self.prompt_tokens.labels(name).inc(s.prompt_tokens)
        self.request_success.labels(name, s.finish_reason).inc()
        self.preemptions.labels(name).inc(s.num_preemptions)
        self.rotations.labels(name).inc(s.num_rotations)
        for kind, met in (("ttft", s.ttft_met), ("tbt", s.tbt_met)):
            if met is True:
                self.slo_attained.labels(name, kind).inc()
            elif met is False:
                self.slo_violated.labels(name, kind).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _spec_decode(view: EngineStats, model_name: str, labels: list[str]) -> Iterator[Any]:
    """vLLM's speculative-decoding counters (only when speculation is on)."""
    spec = view.spec_decode
    if spec is None:
        return
    for name, value, doc in (
        ("spec_decode_num_drafts", spec.num_drafts, "Number of spec decoding drafts."),
        ("spec_decode_num_draft_tokens", spec.num_draft_tokens, "Number of draft tokens."),
        ("spec_decode_num_accepted_tokens", spec.num_accepted_tokens,
         "Number of accepted tokens."),
    ):
        c = CounterMetricFamily(VLLM_PREFIX + name, doc, labels=labels)
        c.add_metric([model_name], value)
        yield c
    per_pos = CounterMetricFamily(VLLM_PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                  "Accepted tokens per draft position.",
                                  labels=[*labels, "position"])
    for i, n in enumerate(spec.accepted_per_pos):
        per_pos.add_metric([model_name, str(i)], n)
    yield per_pos
