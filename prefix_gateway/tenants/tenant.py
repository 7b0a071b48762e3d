"""A named tenant while the gateway runs: its budgets, its requests in flight and what it used.

A request takes one request and its reservation of tokens from the budgets when it is
admitted (`prefix_gateway.tenants.cost`), and is settled once when it ends: the reservation
less what it is charged goes back (or, charged more than it reserved, more is taken). Where the
budgets are kept (this process's share, or the fleet's buckets in Redis) is the gate's
business; the tenant holds both views (`Allowance`).
"""

from __future__ import annotations

import math
from collections import Counter

from prefix_gateway.config.tenants import TenantSpec
from prefix_gateway.errors import GatewayError, Headers
from prefix_gateway.refusals import refused
from prefix_gateway.tenants.allowance import Allowance
from prefix_gateway.tenants.budget import duration_text
from prefix_gateway.tenants.cost import Usage, used_cost


class TenantRefused(Exception):
    """A request its tenant's limits refuse: the client's 429, and which limit it was."""

    def __init__(self, error: GatewayError, reason: str) -> None:
        super().__init__(error.message)
        self.error = error
        self.reason = reason


class Tenant:
    __slots__ = (
        "in_flight",
        "name",
        "refusals",
        "requests",
        "reserved",
        "spec",
        "statuses",
        "tokens",
        "used",
    )

    def __init__(
        self, spec: TenantSpec, now: float, share: float = 1.0, fleet_wide: bool = False
    ) -> None:
        """`share`: the part of each limit this process charges locally (1 / its workers);
        `fleet_wide`: the limits are the fleet's, charged in Redis while it answers."""
        self.spec = spec
        self.name = spec.name
        rpm, tpm = spec.requests_per_minute, spec.tokens_per_minute
        self.requests = Allowance(rpm, share, now, fleet_wide) if rpm else None
        self.tokens = Allowance(tpm, share, now, fleet_wide) if tpm else None
        self.in_flight = 0
        self.reserved = 0.0
        """Tokens its admitted requests reserved and have not settled yet."""
        self.used = Usage()
        self.statuses: Counter[int] = Counter()
        self.refusals: Counter[str] = Counter()

    @property
    def allowances(self) -> tuple[tuple[str, Allowance], ...]:
        """The budgets per minute this tenant has, by kind (`requests`, `tokens`)."""
        found = (("requests", self.requests), ("tokens", self.tokens))
        return tuple((kind, allowance) for kind, allowance in found if allowance is not None)

    def enter(self, now: float) -> None:
        """One more request in flight; a 429 (`rate_limit_exceeded`) if that is one too many."""
        limit = self.spec.max_concurrency
        if limit and self.in_flight >= limit:
            raise self.crowded(f"{self.in_flight} requests in flight, its limit", now)
        self.in_flight += 1

    def crowded(self, count: str, now: float) -> TenantRefused:
        """The refusal of a request beyond `max_concurrency`: `count` says how many are in
        flight where, against what."""
        message = f"tenant {self.name} has {count}; retry when one has ended"
        return self._refusal("max_concurrency", message, 1.0, now)

    def leave(self) -> None:
        """A request `enter` counted is no longer in flight."""
        self.in_flight -= 1

    def take(self, estimate: float, now: float) -> float:
        """Reserve one request and `estimate` tokens in this process's share: the tokens
        reserved; a 429 that says which limit, and when to try again, if they do not fit."""
        requests, tokens = self.requests, self.tokens
        if requests is not None:
            wait = requests.take(1, now)
            if wait:
                raise self.over("requests", wait, estimate, now)
        if tokens is None:
            return 0.0
        wait = tokens.take(estimate, now)
        if wait:
            if requests is not None:
                requests.give(1, now)
            raise self.over("tokens", wait, estimate, now)
        return estimate

    def reshare(self, share: float, now: float) -> None:
        """This process's part of each limit is now `share`."""
        for _, allowance in self.allowances:
            allowance.reshare(share, now)

    def over(self, kind: str, wait: float, estimate: float, now: float) -> TenantRefused:
        """The refusal of a request of `estimate` tokens that budget `kind` cannot take for
        `wait` seconds (infinite: ever)."""
        spec = self.spec
        if kind == "requests":
            message = (
                f"rate limit reached for tenant {self.name} on requests per minute:"
                f" limit {spec.requests_per_minute}"
            )
        elif math.isinf(wait):
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
        return self._refusal(f"{kind}_per_minute", message, wait, now)

    def headers(self, now: float) -> Headers:
        """OpenAI's `x-ratelimit-*` headers for the budgets this tenant has."""
        found: list[tuple[bytes, bytes]] = []
        for kind, allowance in self.allowances:
            name = kind.encode()
            reset = duration_text(allowance.reset_seconds(now))
            found += [
                (b"x-ratelimit-limit-" + name, str(allowance.limit).encode()),
                (b"x-ratelimit-remaining-" + name, str(allowance.remaining(now)).encode()),
                (b"x-ratelimit-reset-" + name, reset.encode()),
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


class Reservation:
    """What one admitted request holds of its tenant until it is settled: a place among its
    requests in flight, and the tokens it reserved."""

    __slots__ = ("reserved", "shared", "tenant")

    def __init__(self, tenant: Tenant, reserved: float, shared: bool = False) -> None:
        self.tenant = tenant
        self.reserved = reserved
        """The tokens taken from the budget at admission."""
        tenant.reserved += reserved
        self.shared = shared
        """Taken from the fleet's budgets in Redis (else from this process's share)."""

    def settle(self, status: int, usage: Usage | None, cached_cost: float) -> float:
        """End the request, with `status` and `usage` (None: nothing is charged): the tokens
        its budget is owed back (negative: the reservation fell short)."""
        tenant = self.tenant
        tenant.leave()
        tenant.reserved -= self.reserved
        tenant.statuses[status] += 1
        charged = 0.0
        if usage is not None:
            tenant.used.prompt += usage.prompt
            tenant.used.cached += usage.cached
            tenant.used.completion += usage.completion
            charged = used_cost(usage, cached_cost)
        if tenant.tokens is None:
            return 0.0
        return self.reserved - charged
