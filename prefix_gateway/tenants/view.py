"""A tenant as `/admin/tenants` shows it: its limits, what it has in flight and reserved, what
remains of its budgets (the fleet's when they are shared through Redis) and what it used, as
this gateway process counts them (docs/tenants.md)."""

from __future__ import annotations

from typing import Any

from prefix_gateway.tenants.tenant import Tenant


def tenant_view(tenant: Tenant, now: float, waiting: int) -> dict[str, Any]:
    spec = tenant.spec
    budgets = {
        kind: {
            "remaining": allowance.remaining(now),
            "reset_seconds": round(allowance.reset_seconds(now), 3),
            # Whether the figures are the fleet's, as Redis last gave them, or this process's
            # share of the limit scaled up.
            "shared": allowance.shared,
            "share": round(allowance.share, 4),
        }
        for kind, allowance in tenant.allowances
    }
    return {
        "name": tenant.name,
        "priority": spec.priority,
        "weight": spec.weight,
        "limits": {
            "requests_per_minute": spec.requests_per_minute,
            "tokens_per_minute": spec.tokens_per_minute,
            "max_concurrency": spec.max_concurrency,
        },
        "in_flight": tenant.in_flight,
        "reserved_tokens": round(tenant.reserved),
        "waiting": waiting,
        "budgets": budgets,
        "requests": {str(status): count for status, count in sorted(tenant.statuses.items())},
        "refusals": dict(sorted(tenant.refusals.items())),
        "tokens": {
            "prompt": tenant.used.prompt,
            "cached": tenant.used.cached,
            "completion": tenant.used.completion,
        },
    }
