"""The per-tenant series (docs/metrics.md, "Tenants"): counted only with a `tenants:` list;
`tenant` is a configured name or `anonymous`, so that clients cannot mint series."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class TenantSeries:
    def __init__(self, registry: CollectorRegistry, buckets: Sequence[float]) -> None:
        self.requests = Counter(
            "gateway_tenant_requests",
            "Requests answered, by tenant and status (429: refused by the tenant's limits).",
            ["tenant", "status"],
            registry=registry,
        )
        self.tokens = Counter(
            "gateway_tenant_tokens",
            "Tokens the engines reported for a tenant's requests, by kind (prompt, cached,"
            " completion).",
            ["tenant", "kind"],
            registry=registry,
        )
        self.refusals = Counter(
            "gateway_tenant_refusals",
            "Requests refused by a tenant's limits, by the limit.",
            ["tenant", "reason"],
            registry=registry,
        )
        self.wait_seconds = Histogram(
            "gateway_tenant_wait_seconds",
            "Time a request waited in the gateway for a replica's free slot (flow control).",
            ["tenant"],
            buckets=buckets,
            registry=registry,
        )
        self.in_flight = Gauge(
            "gateway_tenant_in_flight",
            "A tenant's requests admitted and not yet answered.",
            ["tenant"],
            multiprocess_mode="livesum",
            registry=registry,
        )
        self.reserved_tokens = Gauge(
            "gateway_tenant_reserved_tokens",
            "Tokens a tenant's admitted requests reserved against its budget and have not"
            " settled yet.",
            ["tenant"],
            multiprocess_mode="livesum",
            registry=registry,
        )
        self.budget_remaining = Gauge(
            "gateway_tenant_budget_remaining",
            "What remains of a tenant's budget for the minute, by budget (requests, tokens).",
            ["tenant", "budget"],
            multiprocess_mode="livemin",
            registry=registry,
        )
