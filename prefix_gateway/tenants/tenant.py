"""A named tenant while the gateway runs: its budgets, its requests in flight and what it used.

A request is charged when it is admitted — one request, and its tokens as estimated: the
prompt's plus its `max_tokens` (or `--budget-max-tokens`) — and settled when its answer ends
with what the engine reported: prompt tokens not cached, cached prompt tokens at
`--cached-token-cost` (the cache made them cheap: a tenant's repeated prefix costs it less),
and the completion. An answer that is not a success gives the tokens back; one whose usage is
unknown keeps the estimate. Where the budgets are charged (this process's share, or the
fleet's buckets in Redis) is the gate's business; the tenant holds both views (`Allowance`).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from prefix_gateway.config.tenants import TenantSpec
from prefix_gateway.errors import GatewayError, Headers
from prefix_gateway.refusals import refused
from prefix_gateway.tenants.allowance import Allowance
from prefix_gateway.tenants.budget import duration_text
from prefix_gateway.tenants.cost import used_cost


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
        """Charge a request of about `estimate` tokens to this process's share: the tokens
        charged; a 429 that says which limit, and when to try again, if it does not fit."""
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


class Charge:
    """What one admitted request holds of its tenant until it is settled."""

    __slots__ = ("charged", "shared", "tenant")

    def __init__(self, tenant: Tenant, charged: float, shared: bool = False) -> None:
        self.tenant = tenant
        self.charged = charged
        """The tokens taken at admission."""
        self.shared = shared
        """Taken from the fleet's budgets in Redis (else from this process's share)."""

    def settle(
        self, status: int, usage: tuple[int | None, int | None, int | None], cached_cost: float
    ) -> tuple[Usage, float]:
        """End the request: what it used, as far as known (prompt, cached, completion as the
        engine reported them), and the tokens its budget is owed back for it (negative: the
        estimate fell short)."""
        tenant = self.tenant
        tenant.leave()
        tenant.statuses[status] += 1
        prompt, cached, completion = (count or 0 for count in usage)
        used = Usage(prompt, cached, completion)
        tenant.used.prompt += prompt
        tenant.used.cached += cached
        tenant.used.completion += completion
        if tenant.tokens is None or not self.charged:
            return used, 0.0
        if status != 200:
            return used, self.charged
        if usage[0] is not None or usage[2] is not None:
            return used, self.charged - used_cost(prompt, cached, completion, cached_cost)
        return used, 0.0
