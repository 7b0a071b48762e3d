"""Every Prometheus series the gateway exports, defined in one place.

Names and labels are a public interface (dashboards and alerts depend on them; docs/metrics.md
lists every one); labels carry only bounded values: model names the pool serves, backend names,
route reasons, status codes and fixed cause names — never session ids or prompts.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
)
_DECISION_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.01)
_REDIS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


class _Registry(CollectorRegistry):
    """Leaves out the `*_created` series the client library adds to every counter and histogram:
    they double the series a scrape stores and no dashboard or alert reads them."""

    def collect(self) -> Iterable[Metric]:
        for family in super().collect():
            if family.type in ("counter", "histogram"):
                family.samples = [
                    sample for sample in family.samples if not sample.name.endswith("_created")
                ]
            yield family


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or _Registry()
        r = self.registry
        self.requests = Counter(
            "gateway_requests",
            "Requests answered, by model, backend, route reason and status.",
            ["model", "backend", "route", "status"],
            registry=r,
        )
        self.rejected = Counter(
            "gateway_rejected_requests",
            "Requests refused by the gateway itself, by status code.",
            ["status", "code"],
            registry=r,
        )
        self.decision_seconds = Histogram(
            "gateway_routing_decision_seconds",
            "Time to parse, hash, match and choose a backend for one request.",
            ["policy"],
            buckets=_DECISION_BUCKETS,
            registry=r,
        )
        self.prompt_tokens_estimated = Counter(
            "gateway_prompt_tokens_estimated",
            "Prompt tokens as estimated by the gateway's block chunking.",
            ["model"],
            registry=r,
        )
        self.matched_tokens_predicted = Counter(
            "gateway_matched_tokens_predicted",
            "Prompt tokens the index predicted to be cached on the chosen backend.",
            ["model"],
            registry=r,
        )
        self.upstream_prompt_tokens = Counter(
            "gateway_upstream_prompt_tokens",
            "Prompt tokens reported by backends in response usage.",
            ["model", "backend"],
            registry=r,
        )
        self.upstream_cached_tokens = Counter(
            "gateway_upstream_cached_tokens",
            "Cached prompt tokens reported by backends (usage.prompt_tokens_details).",
            ["model", "backend"],
            registry=r,
        )
        self.in_flight = Gauge(
            "gateway_backend_in_flight",
            "Requests in flight to each backend from this gateway.",
            ["backend"],
            registry=r,
        )
        self.healthy = Gauge(
            "gateway_backend_healthy",
            "1 when the backend receives traffic, 0 when ejected.",
            ["backend"],
            registry=r,
        )
        self.first_byte_seconds = Histogram(
            "gateway_upstream_first_byte_seconds",
            "Time from sending a request upstream to its first body byte.",
            ["backend"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.duration_seconds = Histogram(
            "gateway_upstream_duration_seconds",
            "Time from sending a request upstream to the end of its response.",
            ["backend"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.overflows = Counter(
            "gateway_load_bound_overflows",
            "Requests sent past their preferred backend because it was over the load bound.",
            ["model"],
            registry=r,
        )
        self.retries = Counter(
            "gateway_upstream_retries",
            "Attempts moved to another backend, by cause.",
            ["cause"],
            registry=r,
        )
        self.upstream_errors = Counter(
            "gateway_upstream_errors",
            "Upstream failures, by backend and cause.",
            ["backend", "cause"],
            registry=r,
        )
        self.client_disconnects = Counter(
            "gateway_client_disconnects",
            "Requests whose client went away before the response was complete.",
            ["model"],
            registry=r,
        )
        self.index_blocks = Gauge(
            "gateway_index_blocks",
            "Prefix blocks held by the local prefix index.",
            registry=r,
        )
        self.queued = Gauge(
            "gateway_backend_queued",
            "Requests waiting in each backend engine's own queue, as last scraped.",
            ["backend"],
            registry=r,
        )
        self.load_bound = Gauge(
            "gateway_backend_load_bound",
            "The load bound a new request meets at each backend (the largest over its models).",
            ["backend"],
            registry=r,
        )
        self.failovers = Counter(
            "gateway_failovers",
            "Requests answered by another backend after their first choice failed.",
            ["model"],
            registry=r,
        )
        self.affinity_hits = Counter(
            "gateway_affinity_hits",
            "Requests continuing a conversation served by its previous request's backend.",
            ["model"],
            registry=r,
        )
        self.affinity_misses = Counter(
            "gateway_affinity_misses",
            "Requests continuing a conversation served elsewhere, by cause.",
            ["model", "cause"],
            registry=r,
        )
        self.cache_breaks = Counter(
            "gateway_cache_breaks",
            "Conversation requests whose prompt no longer extends the previous one, by cause.",
            ["model", "cause"],
            registry=r,
        )
        self.conversations = Gauge(
            "gateway_conversations_tracked",
            "Conversation keys remembered for affinity and cache-break accounting.",
            registry=r,
        )

        # --- Shared state in Redis and sticky sessions ---------------------------------------
        self.redis_seconds = Histogram(
            "gateway_redis_operation_seconds",
            "Time of one Redis operation that completed, by operation.",
            ["operation"],
            buckets=_REDIS_BUCKETS,
            registry=r,
        )
        self.redis_errors = Counter(
            "gateway_redis_errors",
            "Redis operations that failed or timed out, by operation.",
            ["operation"],
            registry=r,
        )
        self.redis_fallbacks = Counter(
            "gateway_redis_fallbacks",
            "Operations served by local state alone because Redis was down, slow or busy.",
            ["operation"],
            registry=r,
        )
        self.redis_up = Gauge(
            "gateway_redis_up",
            "1 while Redis answers within its timeout, 0 when down or not configured.",
            registry=r,
        )
        self.session_moves = Counter(
            "gateway_session_moves",
            "Sticky sessions moved to another backend, by cause.",
            ["cause"],
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
