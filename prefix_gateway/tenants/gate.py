"""The tenants' gate on the proxy path: which tenant a client key is, its charge when its
request is admitted, its settlement when the answer ends, and the per-tenant series.

Built only when the configuration names tenants: without them the proxy path does not call it.
Every request no named tenant sent is counted as `anonymous`, so that clients cannot mint
series. Budgets are this process's alone without Redis (with `--workers N` each worker holds an
equal share of every limit); with Redis they are the fleet's (`SharedBudgets`, docs/tenants.md),
and so are the caps on requests in flight (`SharedSlots`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prefix_gateway.config import Settings
from prefix_gateway.config.tenants import ANONYMOUS
from prefix_gateway.metrics import Metrics
from prefix_gateway.prompt.parsing import RoutingInput
from prefix_gateway.routing.types import Outcome
from prefix_gateway.tenants.cost import estimated_cost
from prefix_gateway.tenants.shared import SharedBudgets
from prefix_gateway.tenants.slots import SharedSlots
from prefix_gateway.tenants.tenant import Charge, Tenant, TenantRefused, Usage


class TenantGate:
    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
        shared: SharedBudgets | None = None,
        slots: SharedSlots | None = None,
    ) -> None:
        now = clock()
        share = 1.0 / settings.workers
        fleet_wide = shared is not None
        self.tenants = [Tenant(spec, now, share, fleet_wide) for spec in settings.tenants]
        self.by_name = {tenant.name: tenant for tenant in self.tenants}
        self._first_key = len(settings.api_key)
        self._metrics = metrics
        self._clock = clock
        self._shared = shared
        self._slots = slots
        if slots is not None:
            for tenant in self.tenants:
                if tenant.spec.max_concurrency:
                    slots.track(tenant)
        self._chars_per_token = settings.chars_per_token
        self._completion_estimate = settings.budget_max_tokens
        self._cached_cost = settings.cached_token_cost
        for tenant in self.tenants:
            self._publish(tenant)

    def of_key(self, position: int) -> Tenant | None:
        """The tenant whose key is at `position` among the client keys (`--api-key`'s first,
        anonymous)."""
        index = position - self._first_key
        return self.tenants[index] if index >= 0 else None

    async def admit(self, tenant: Tenant | None, request: RoutingInput) -> Charge | None:
        """Charge `request` to `tenant` (None: anonymous, not charged); the 429 that refuses
        it, its limit counted, if it does not fit."""
        if tenant is None:
            return None
        estimate = estimated_cost(request, self._chars_per_token, self._completion_estimate)
        metrics = self._metrics
        try:
            # In flight from here, so that requests admitted meanwhile count against the cap.
            tenant.enter(self._clock())
            try:
                slots = self._slots
                if slots is not None and tenant.spec.max_concurrency:
                    await slots.enter(tenant, self._clock())
                charge = await self._charge(tenant, estimate)
            except BaseException:
                tenant.leave()
                self._left(tenant)
                raise
        except TenantRefused as refusal:
            metrics.child(metrics.tenants.refusals, tenant.name, refusal.reason).inc()
            self._publish(tenant)
            raise refusal.error from None
        metrics.tenants.in_flight.labels(tenant.name).inc()
        self._publish(tenant)
        return charge

    def refused(self, tenant: Tenant | None, status: int) -> None:
        """A request of `tenant` answered by the gateway itself: refused or failed before any
        replica was asked."""
        name = ANONYMOUS if tenant is None else tenant.name
        self._metrics.child(self._metrics.tenants.requests, name, str(status)).inc()

    def release(self, charge: Charge | None, status: int) -> None:
        """A charged request that ends before any replica was asked (its refusal counted by
        `refused`): its tokens back."""
        if charge is not None:
            _, owed = charge.settle(status, (None, None, None), self._cached_cost)
            self._give(charge, owed)
            self._ended(charge.tenant)

    def settle(self, charge: Charge | None, outcome: Outcome | None) -> Usage | None:
        """A request forwarded ended with `outcome` (None: cut short before it had one):
        charged as used, and counted; what it used, if the engine said."""
        status = 499 if outcome is None else outcome.status
        usage: tuple[int | None, int | None, int | None] = (None, None, None)
        if outcome is not None:
            usage = (outcome.prompt_tokens, outcome.cached_tokens, outcome.completion_tokens)
        if charge is None:
            name = ANONYMOUS
            prompt, cached, completion = (count or 0 for count in usage)
        else:
            name = charge.tenant.name
            used, owed = charge.settle(status, usage, self._cached_cost)
            self._give(charge, owed)
            prompt, cached, completion = used.prompt, used.cached, used.completion
            self._ended(charge.tenant)
        metrics = self._metrics
        metrics.child(metrics.tenants.requests, name, str(status)).inc()
        for kind, count in (("prompt", prompt), ("cached", cached), ("completion", completion)):
            if count:
                metrics.child(metrics.tenants.tokens, name, kind).inc(count)
        if status != 200 or (usage[0] is None and usage[2] is None):
            return None
        return Usage(prompt, cached, completion)

    async def _charge(self, tenant: Tenant, estimate: float) -> Charge:
        shared = self._shared
        if shared is not None and tenant.allowances:
            return await shared.take(tenant, estimate)
        return Charge(tenant, tenant.take(estimate, self._clock()))

    def _give(self, charge: Charge, tokens: float) -> None:
        """Settle a charge where it was taken: the fleet's budget, or this process's share."""
        if not tokens or charge.tenant.tokens is None:
            return
        if charge.shared and self._shared is not None:
            self._shared.give(charge.tenant, tokens, self._publish)
        else:
            charge.tenant.tokens.give(tokens, self._clock())

    def _ended(self, tenant: Tenant) -> None:
        self._metrics.tenants.in_flight.labels(tenant.name).dec()
        self._left(tenant)
        self._publish(tenant)

    def _left(self, tenant: Tenant) -> None:
        """A request of `tenant` no longer in flight: the fleet's count follows."""
        slots = self._slots
        if slots is not None and tenant.spec.max_concurrency:
            slots.publish(tenant)

    def _publish(self, tenant: Tenant) -> None:
        """The tenant's budgets as they stand now (the fleet's when Redis gave the last
        figure), on the remaining-budget gauge."""
        now = self._clock()
        gauge = self._metrics.tenants.budget_remaining
        for kind, allowance in tenant.allowances:
            gauge.labels(tenant.name, kind).set(allowance.remaining(now))
