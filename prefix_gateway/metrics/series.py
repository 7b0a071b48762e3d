"""Every Prometheus series the gateway exports, defined in one place (docs/metrics.md).

Names and labels are a public interface; labels carry only bounded values. Under `--workers`
each gauge is combined over the workers by the `multiprocess_mode` given with it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from prefix_gateway.metrics.adapters import AdapterSeries
from prefix_gateway.metrics.first_token import FirstTokenSeries
from prefix_gateway.metrics.leases import LeaseSeries
from prefix_gateway.metrics.process import ProcessSeries
from prefix_gateway.metrics.registry import (
    MULTIPROCESS_DIR_VARIABLE,
    Registry,
    render,
    worker_restarts_counter,
)
from prefix_gateway.metrics.tenants import TenantSeries
from prefix_gateway.metrics.values import use_loop_values

# fmt: off
# Up to the default --request-timeout (3,600 s): a request that long still lands in a bucket.
_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120,
    300, 600, 1200, 1800, 3600,
)
# fmt: on
_DECISION_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.01)
_GAP_BUCKETS = (-4096, -1024, -256, -64, -16, 0, 16, 32, 64, 256, 1024, 4096)
_REDIS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or Registry()
        r = self.registry
        # The switch prometheus_client itself reads when it is first imported.
        self.multiprocess_dir = os.environ.get(MULTIPROCESS_DIR_VARIABLE) or None
        if self.multiprocess_dir is None:
            use_loop_values()
        self._published: dict[Gauge, set[str]] = {}
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.requests = Counter(
            "gateway_requests",
            "Requests answered, by model, backend, route reason and status.",
            ["model", "backend", "route", "status"],
            registry=r,
        )
        self.rejected = Counter(
            "gateway_rejected_requests",
            "Errors the gateway answered itself on the proxy path, by status and error code.",
            ["status", "code"],
            registry=r,
        )
        self.decision_seconds = Histogram(
            "gateway_routing_decision_seconds",
            "Time to route one parsed request: hash its prompt, look it up in the index (and its"
            " session), and choose a backend.",
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
        self.index_feedback = Counter(
            "gateway_index_feedback",
            "Responses whose cached tokens confirmed, fell short of or exceeded the index's"
            " prediction, by outcome.",
            ["model", "backend", "outcome"],
            registry=r,
        )
        self.index_feedback_pruned_blocks = Counter(
            "gateway_index_feedback_pruned_blocks",
            "Index blocks forgotten for a backend because a response showed it had evicted them.",
            ["model", "backend"],
            registry=r,
        )
        self.index_feedback_gap_tokens = Histogram(
            "gateway_index_feedback_gap_tokens",
            "Cached tokens predicted by the index minus those the backend reported.",
            ["model"],
            buckets=_GAP_BUCKETS,
            registry=r,
        )
        self.index_feedback_errors = Counter(
            "gateway_index_feedback_errors",
            "Failures while learning from a response's cached tokens (the response was unharmed).",
            registry=r,
        )
        self.prefill_waits = Counter(
            "gateway_prefill_waits",
            "Requests held while their prefix was being computed on their replica, by how the"
            " wait ended: `computed` (the earlier request's first token came) or `timeout`.",
            ["outcome"],
            registry=r,
        )
        self.prefill_wait_seconds = Histogram(
            "gateway_prefill_wait_seconds",
            "How long requests were held for a prefill in progress on their replica.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "gateway_backend_in_flight",
            "Requests in flight to each backend from this gateway.",
            ["backend"],
            multiprocess_mode="livesum",
            registry=r,
        )
        self.healthy = Gauge(
            "gateway_backend_healthy",
            "1 when the backend receives traffic, 0 when ejected.",
            ["backend"],
            multiprocess_mode="livemax",
            registry=r,
        )
        self.kv_events_live = Gauge(
            "gateway_kv_events_live",
            "1 while the backend's KV-cache events flow and routing reads its blocks from"
            " them (--kv-events), 0 when it went back to the predicted index.",
            ["backend"],
            multiprocess_mode="livemax",
            registry=r,
        )
        self.kv_events = Counter(
            "gateway_kv_events_messages",
            "KV-cache event messages received from each backend's engine.",
            ["backend"],
            registry=r,
        )
        self.kv_events_fallbacks = Counter(
            "gateway_kv_events_fallbacks",
            "Times a backend's events stopped flowing and routing went back to the predicted"
            " index, by reason (disconnected, missed).",
            ["backend", "reason"],
            registry=r,
        )
        self.kv_events_undecodable = Counter(
            "gateway_kv_events_undecodable",
            "KV-cache event messages that could not be decoded, by backend.",
            ["backend"],
            registry=r,
        )
        self.stalled = Gauge(
            "gateway_backend_stalled",
            "1 while the backend is out of routing as stalled (answering probes, producing"
            " nothing), until an inference probe passes.",
            ["backend"],
            multiprocess_mode="livemax",
            registry=r,
        )
        self.backend_check = Gauge(
            "gateway_backend_check",
            "1 when the backend passed the doctor's check at its last run, 0 when it failed it"
            " (absent: not run, or nothing to judge it by).",
            ["backend", "check"],
            multiprocess_mode="livemin",
            registry=r,
        )
        self.stalls = Counter(
            "gateway_backend_stalls",
            "Times a backend was found stalled and taken out of routing.",
            ["backend"],
            registry=r,
        )
        self.first_byte_seconds = Histogram(
            "gateway_upstream_first_byte_seconds",
            'Time from sending a request upstream to its first body byte: with stream="true"'
            ' the first event of a streamed answer (time to first token), with stream="false"'
            " a whole answer.",
            ["backend", "stream"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.first_token = FirstTokenSeries(r)
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
        self.upstream_resends = Counter(
            "gateway_upstream_resends",
            "Requests sent again on a new connection to the same backend because the kept-alive"
            " one closed before the backend could have read them, by reason.",
            ["reason"],
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
            multiprocess_mode="livesum",
            registry=r,
        )
        self.pending_prefill = Gauge(
            "gateway_backend_pending_prefill_blocks",
            "Prompt blocks this gateway has sent each backend that have not had their first byte"
            " back (the unmatched blocks of each request, by the index's estimate).",
            ["backend"],
            multiprocess_mode="livesum",
            registry=r,
        )
        self.queued = Gauge(
            "gateway_backend_queued",
            "Load at each backend that this gateway did not send: the other gateways' requests in"
            " flight (through Redis) plus what the engine reported beyond them at its last scrape.",
            ["backend"],
            multiprocess_mode="livemax",
            registry=r,
        )
        self.load_bound = Gauge(
            "gateway_backend_load_bound",
            "The load bound a new request meets at each backend (the largest over its models).",
            ["backend"],
            multiprocess_mode="livesum",
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
            multiprocess_mode="livesum",
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
            multiprocess_mode="livemin",
            registry=r,
        )
        self.session_moves = Counter(
            "gateway_session_moves",
            "Sticky sessions moved to another backend, by cause.",
            ["cause"],
            registry=r,
        )

        # --- LoRA adapters (label values: the adapters replicas list or `lora_adapters` names)
        self.adapters = AdapterSeries(r)

        # --- Tenants (only with `tenants:`; `anonymous` for every other client) -------------
        self.tenants = TenantSeries(r, _LATENCY_BUCKETS)
        self.leases = LeaseSeries(r)

        # --- Worker processes ---------------------------------------------------------------
        self.workers = Gauge(
            "gateway_workers",
            "Worker processes serving the gateway's port (1 without --workers).",
            multiprocess_mode="livesum",
            registry=r,
        )
        self.workers.set(1)  # this process; dead workers' files are dropped from the sum
        self.worker_restarts = worker_restarts_counter(r)
        self.process = ProcessSeries(r, multiprocess=self.multiprocess_dir is not None)

    def forget_backend(self, name: str) -> None:
        """Drop every series labelled with `name`, a backend that left the pool (under
        several workers the multiprocess files keep them until the workers restart)."""
        for family in self._families():
            names = getattr(family, "_labelnames", ())
            if "backend" not in names:
                continue
            position = names.index("backend")
            for values in list(getattr(family, "_metrics", {})):
                if values[position] == name:
                    family.remove(*values)
        self._children.clear()

    def _families(self) -> list[Counter | Gauge | Histogram]:
        kinds = (Counter, Gauge, Histogram)
        groups = (self, self.adapters, self.tenants, self.leases, self.first_token)
        families = (value for group in groups for value in vars(group).values())
        return [family for family in families if isinstance(family, kinds)]

    def child(self, family: Counter | Histogram, *values: str) -> Any:
        """`family.labels(*values)`, cached (label values are bounded); not for gauges, which
        `set_per_label` clears."""
        key = (id(family), values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = family.labels(*values)
        return found

    def set_per_label(self, gauge: Gauge, values: Mapping[str, float]) -> None:
        """Sets a one-label gauge to exactly `values`; a label value no longer given leaves it
        (drops to 0 under several workers, whose files cannot remove a series)."""
        if self.multiprocess_dir is None:
            gauge.clear()
        else:
            for gone in self._published.get(gauge, set()) - values.keys():
                gauge.labels(gone).set(0)
            self._published[gauge] = set(values)
        for label, value in values.items():
            gauge.labels(label).set(value)

    def render(self) -> bytes:
        return render(self.registry, self.multiprocess_dir)
