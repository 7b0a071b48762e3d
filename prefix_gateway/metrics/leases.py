"""What the requests in progress hold of the gateway, read from its live state at each scrape
(docs/metrics.md, "What requests hold"): each returns to zero once they have all ended."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge


class LeaseSeries:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.admitted = Gauge(
            "gateway_requests_admitted",
            "Requests holding one of the slots of requests proxied at once (--max-concurrency).",
            multiprocess_mode="livesum",
            registry=registry,
        )
        self.waiting = Gauge(
            "gateway_requests_waiting",
            "Requests waiting in the gateway, by queue: `admission` (for a slot of"
            " --max-concurrency) and `flow` (for a replica's slot, flow control).",
            ["queue"],
            multiprocess_mode="livesum",
            registry=registry,
        )
        self.body_bytes = Gauge(
            "gateway_request_body_bytes_held",
            "Bytes of request bodies the gateway holds, from their first byte read until their"
            " request ends (bounded by --max-pending-body-bytes).",
            multiprocess_mode="livesum",
            registry=registry,
        )
        self.open_placements = Gauge(
            "gateway_placements_open",
            "Requests placed on a replica whose placement is not settled yet.",
            multiprocess_mode="livesum",
            registry=registry,
        )
