"""vLLM's Prometheus metrics (V1 names, labels and buckets) for one emulated engine; all but
the two histograms are read from the engine when scraped.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prefix_gateway.emulator.engine import FINISH_REASONS, Engine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LABELS = ["model_name", "engine"]
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class EngineMetrics:
    """The latency histograms an engine reports to, and the scrape of everything else."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._label_values = [model_name, "0"]
        self._ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            _LABELS,
            registry=self.registry,
            buckets=_TTFT_BUCKETS,
        ).labels(*self._label_values)
        self._e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            _LABELS,
            registry=self.registry,
            buckets=_LATENCY_BUCKETS,
        ).labels(*self._label_values)

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def finished(self, seconds: float) -> None:
        self._e2e.observe(seconds)

    def watch(self, engine: Engine) -> None:
        self.registry.register(_EngineCollector(engine, self._label_values))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    def __init__(self, engine: Engine, label_values: list[str]) -> None:
        self._engine = engine
        self._labels = label_values

    def collect(self) -> Iterable[Metric]:
        engine, cache, stats = self._engine, self._engine.cache, self._engine.stats
        yield self._gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            engine.running,
        )
        yield self._gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            engine.waiting,
        )
        yield self._gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", cache.usage
        )
        yield self._counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            cache.queries,
        )
        yield self._counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            cache.hits,
        )
        yield self._counter(
            "emulator_prefix_misses_in_flight",
            "Requests whose first uncached prompt block another running request was computing"
            " (not a vLLM metric).",
            cache.in_flight_misses,
        )
        yield self._counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens
        )
        yield self._counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            stats.generation_tokens,
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*_LABELS, "finished_reason"],
        )
        for reason in FINISH_REASONS:
            success.add_metric([*self._labels, reason], stats.finished[reason])
        yield success
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=["block_size", "enable_prefix_caching", "engine", "num_gpu_blocks"],
        )
        info.add_metric([str(cache.block_size), "True", "0", str(cache.capacity_blocks)], 1.0)
        yield info

    def _gauge(self, name: str, documentation: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, documentation, labels=_LABELS)
        family.add_metric(self._labels, value)
        return family

    def _counter(self, name: str, documentation: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, documentation, labels=_LABELS)
        family.add_metric(self._labels, value)
        return family
