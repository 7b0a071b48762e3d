"""A named tenant while the gateway runs: its budgets, its requests in flight and what it used.

A request is charged when it is admitted — one request, and its tokens as estimated: the
prompt's plus its `max_tokens` (or `--budget-max-tokens`) — and settled when its answer ends
with what the engine reported: prompt tokens not cached, cached prompt tokens at
`--cached-token-cost` (the cache made them cheap: a tenant's repeated prefix costs it less),
and the completion. An answer that is not a success gives the tokens back; one whose usage is
unknown keeps the estimate.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from gateway.config.tenants import TenantSpec
from gateway.errors import GatewayError, Headers
from gateway.refusals import refused
from gateway.tenants.budget import MinuteBudget, duration_text
from gateway.tenants.cost import used_cost


class TenantRefused(Exception):
    """A request its tenant's limits refuse: the client's 429, and which limit it was."""

    def __init__(self, error: GatewayError, reason: str) -> None:
        super().__init__(error.message)
        self.error = error
        self.reason = reason


@dataclass(slots=True)
class Usage:
    prompt: int = 0
    cached: int = 0
    completion: int = 0


class Tenant:
    __slots__ = (
        "in_flight",
        "name",
        "refusals",
        "requests",
        "share",
        "spec",
        "statuses",
        "tokens",
        "used",
    )

    def __init__(self, spec: TenantSpec, now: float, share: float = 1.0) -> None:
        self.spec = spec
        self.name = spec.name
        self.share = share
        """The part of each limit this process enforces (1 / its workers)."""
        rpm, tpm = spec.requests_per_minute, spec.tokens_per_minute
        self.requests = MinuteBudget(rpm * share, now) if rpm else None
        self.tokens = MinuteBudget(tpm * share, now) if tpm else None
        self.in_flight = 0
        self.used = Usage()
        self.statuses: Counter[int] = Counter()
        self.refusals: Counter[str] = Counter()

    def admit(self, estimate: float, now: float) -> Charge:
        """Charge a request of about `estimate` tokens; a 429 (`rate_limit_exceeded`) that says
        which limit, and when to try again, if it does not fit."""
        spec = self.spec
        if spec.max_concurrency and self.in_flight >= spec.max_concurrency:
            raise self._refusal(
                "max_concurrency",
                f"tenant {self.name} has {self.in_flight} requests in flight, its limit;"
                " retry when one has ended",
                1.0,
                now,
            )
        requests, tokens = self.requests, self.tokens
        if requests is not None:
            wait = requests.take(1, now)
            if wait:
                raise self._refusal(
                    "requests_per_minute",
                    f"rate limit reached for tenant {self.name} on requests per minute:"
                    f" limit {spec.requests_per_minute}",
                    wait,
                    now,
                )
        charged = 0.0
        if tokens is not None:
            wait = tokens.take(estimate, now)
            if wait:
                if requests is not None:
                    requests.give(1, now)
                if math.isinf(wait):
                    message = (
                        f"request too large for tenant {self.name} on tokens per minute:"
                        f" limit {spec.tokens_per_minute}, requested {math.ceil(estimate)}; ask for"
                        " fewer max_tokens or send a shorter prompt"
                    )
                else:
                    message = (
                        f"rate limit reached for tenant {self.name} on tokens per minute:"
                        f" limit {spec.tokens_per_minute}, requested {math.ceil(estimate)}"
                    )
                raise self._refusal("tokens_per_minute", message, wait, now)
            charged = estimate
        self.in_flight += 1
        return Charge(self, charged)

    def shown(self, remaining: int) -> int:
        """What remains of a limit, as the tenant's whole (this process holds `share` of it)."""
        return remaining if self.share == 1.0 else round(remaining / self.share)

    def headers(self, now: float) -> Headers:
        """OpenAI's `x-ratelimit-*` headers for the budgets this tenant has."""
        spec = self.spec
        found: list[tuple[bytes, bytes]] = []
        for kind, limit, budget in (
            (b"requests", spec.requests_per_minute, self.requests),
            (b"tokens", spec.tokens_per_minute, self.tokens),
        ):
            if budget is not None:
                remaining = self.shown(budget.remaining(now))
                reset = duration_text(budget.reset_seconds(now))
                found += [
                    (b"x-ratelimit-limit-" + kind, str(limit).encode()),
                    (b"x-ratelimit-remaining-" + kind, str(remaining).encode()),
                    (b"x-ratelimit-reset-" + kind, reset.encode()),
                ]
        return tuple(found)

    def _refusal(self, reason: str, message: str, wait: float, now: float) -> TenantRefused:
        self.refusals[reason] += 1
        headers = self.headers(now)
        if not math.isinf(wait):
            headers += (
                (b"retry-after", str(max(1, math.ceil(wait))).encode()),
                (b"retry-after-ms", str(max(1, math.ceil(wait * 1000))).encode()),
            )
        error = refused("rate_limit_exceeded", message=message, headers=headers)
        return TenantRefused(error, reason)


class Charge:
    """What one admitted request holds of its tenant until it is settled."""

    __slots__ = ("charged", "tenant")

    def __init__(self, tenant: Tenant, charged: float) -> None:
        self.tenant = tenant
        self.charged = charged

    def settle(
        self,
        status: int,
        usage: tuple[int | None, int | None, int | None],
        cached_cost: float,
        now: float,
    ) -> Usage:
        """End the request: its tokens charged as used (prompt, cached, completion as the engine
        reported them); what it used, as far as known."""
        tenant = self.tenant
        tenant.in_flight -= 1
        tenant.statuses[status] += 1
        prompt, cached, completion = (count or 0 for count in usage)
        used = Usage(prompt, cached, completion)
        tenant.used.prompt += prompt
        tenant.used.cached += cached
        tenant.used.completion += completion
        tokens = tenant.tokens
        if tokens is not None and self.charged:
            if status != 200:
                tokens.give(self.charged, now)
            elif usage[0] is not None or usage[2] is not None:
                tokens.give(self.charged - used_cost(prompt, cached, completion, cached_cost), now)
        return used
