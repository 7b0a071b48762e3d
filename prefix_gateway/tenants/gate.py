"""The tenants' gate, which a request's life passes through: which tenant a client key is,
its reservation when its request is admitted, its settlement once it ends, and the per-tenant
series.

Built only when the configuration names tenants: without them a request's life does not call
it.
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
from prefix_gateway.tenants.cost import Usage
from prefix_gateway.tenants.shared import SharedBudgets
from prefix_gateway.tenants.slots import SharedSlots
from prefix_gateway.tenants.tenant import Reservation, Tenant, TenantRefused


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
        self._cached_cost = settings.cached_token_cost
        for tenant in self.tenants:
            self._publish(tenant)

    def of_key(self, position: int) -> Tenant | None:
        """The tenant whose key is at `position` among the client keys (`--api-key`'s first,
        anonymous)."""
        index = position - self._first_key
        return self.tenants[index] if index >= 0 else None

    async def admit(self, tenant: Tenant, reserved: float) -> Reservation:
        """Admit a request of `tenant` reserving `reserved` tokens: in flight (within its
        `max_concurrency`, the fleet's with Redis) and its reservation taken from its budgets;
        the 429 that refuses it, its limit counted, if it does not fit."""
        metrics = self._metrics
        try:
            # In flight from here, so that requests admitted meanwhile count against the cap.
            tenant.enter(self._clock())
            try:
                slots = self._slots
                if slots is not None and tenant.spec.max_concurrency:
                    await slots.enter(tenant, self._clock())
                reservation = await self._reserve(tenant, reserved)
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
        return reservation

    def refused(self, tenant: Tenant | None, status: int) -> None:
        """A request of `tenant` (None: anonymous) answered by the gateway before it was
        admitted."""
        name = ANONYMOUS if tenant is None else tenant.name
        self._metrics.child(self._metrics.tenants.requests, name, str(status)).inc()

    def settle(self, reservation: Reservation | None, status: int, usage: Usage | None) -> None:
        """An admitted request ended with `status`, having used `usage` (None: nothing is
        charged): its reservation settled against what it used, once, and counted
        (`reservation` None: an anonymous request, counted only)."""
        if reservation is None:
            name = ANONYMOUS
        else:
            tenant = reservation.tenant
            name = tenant.name
            self._give(reservation, reservation.settle(status, usage, self._cached_cost))
            self._metrics.tenants.in_flight.labels(name).dec()
            self._left(tenant)
            self._publish(tenant)
        metrics = self._metrics
        metrics.child(metrics.tenants.requests, name, str(status)).inc()
        if usage is not None:
            for kind, count in (
                ("prompt", usage.prompt),
                ("cached", usage.cached),
                ("completion", usage.completion),
            ):
                if count:
                    metrics.child(metrics.tenants.tokens, name, kind).inc(count)

    async def _reserve(self, tenant: Tenant, reserved: float) -> Reservation:
        shared = self._shared
        if shared is not None and tenant.allowances:
            return await shared.take(tenant, reserved)
        return Reservation(tenant, tenant.take(reserved, self._clock()))

    def _give(self, reservation: Reservation, tokens: float) -> None:
        """Settle a reservation where it was taken: the fleet's budget, or this process's."""
        if not tokens or reservation.tenant.tokens is None:
            return
        if reservation.shared and self._shared is not None:
            self._shared.give(reservation.tenant, tokens, self._publish)
        else:
            reservation.tenant.tokens.give(tokens, self._clock())

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
