"""Tenants' `max_concurrency` across a fleet through Redis (docs/tenants.md, concurrency across
a fleet).

Every gateway process writes its own count of each capped tenant's requests in flight to the
tenant's hash (`RedisSlots`), and a request is admitted by one script call only if every live
process's count, this one's new count included, fits the limit. Each write carries this
process's whole live count, never a difference: a write lost or refused is mended by the next
one, and the counts are rewritten every `interval` while any is in flight, which is the
heartbeat that keeps them standing (a dead process's stop counting after the time-to-live)
and re-publishes them once Redis answers again. Releases are written in the background
(a bounded queue, as other writes), at most one per tenant at a time, the last one with the
count as it stands then.

When Redis does not answer within `--redis-timeout` (or is known to be away) a request is
admitted within this process's share of the limit instead (the limit times the share the
budgets use, rounded up, at least 1), and counted in
`gateway_redis_fallbacks_total{operation="tenant_concurrency"}`: no request waits longer for
Redis, none fails for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
from collections.abc import Callable

from prefix_gateway.state.redis.connection import RedisLink, RedisUnavailable
from prefix_gateway.state.redis.slots import RedisSlots
from prefix_gateway.tenants.tenant import Tenant

log = logging.getLogger("prefix_gateway.redis")

ENTER = "tenant_concurrency"
WRITE = "tenant_concurrency_write"
# A count is rewritten this many times within its time-to-live, at most a second apart.
_BEATS_PER_TTL = 4
_MAX_INTERVAL = 1.0
_UNKNOWN = -1


class SharedSlots:
    def __init__(
        self, store: RedisSlots, link: RedisLink, share: Callable[[], float], ttl: float
    ) -> None:
        """`share`: this process's part of a limit while Redis is away; `ttl`: seconds a
        count stands in Redis after it was written."""
        self._store = store
        self._link = link
        self._share = share
        self.interval = min(ttl / _BEATS_PER_TTL, _MAX_INTERVAL)
        self._tenants: list[Tenant] = []
        self._orders = itertools.count()
        self._written: dict[str, tuple[int, int]] = {}
        """Per tenant, the order and count of the latest count Redis took (`_UNKNOWN` after a
        call that failed): rewritten while it is not 0."""
        self._writing: set[str] = set()
        self._stale: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    def track(self, tenant: Tenant) -> None:
        """A tenant with a `max_concurrency`, whose counts the heartbeat keeps standing."""
        self._tenants.append(tenant)

    async def enter(self, tenant: Tenant, now: float) -> None:
        """Admit a request `tenant.in_flight` already counts (`Tenant.enter`), or raise the
        `TenantRefused` of a fleet (or, Redis away, a share) that is full."""
        limit = tenant.spec.max_concurrency
        count = tenant.in_flight
        order = next(self._orders)
        store = self._store
        try:
            reply = await self._link.call(
                ENTER, lambda: store.enter(tenant.name, count, order, limit)
            )
        except RedisUnavailable:
            self._link.fell_back(ENTER)
            self._lost(tenant.name, order)
            # Less a hair, so that a share of exactly 1/3 of 3 is 1, not 2.
            share = max(1, math.ceil(limit * self._share() - 1e-9))
            if count > share:
                text = f"{count - 1} requests in flight here, its share of its limit of {limit}"
                raise tenant.crowded(text, now) from None
            return
        if not reply.done:
            text = f"{reply.fleet_in_flight} requests in flight across the fleet, its limit"
            raise tenant.crowded(text, now)
        self._took(tenant.name, order, count)

    def publish(self, tenant: Tenant, again: bool = False) -> None:
        """Write this process's count for `tenant` in the background, unless Redis has it
        (`again`: even so): once one write is under way the next waits for it and takes the
        count as it stands then."""
        name = tenant.name
        if not again and name not in self._writing and self._count(name) == tenant.in_flight:
            return
        if name in self._writing:
            self._stale.add(name)
            return
        self._writing.add(name)
        if not self._link.submit(WRITE, lambda: self._write(tenant)):
            self._writing.discard(name)

    async def _write(self, tenant: Tenant) -> None:
        name = tenant.name
        self._stale.discard(name)
        try:
            count, order = tenant.in_flight, next(self._orders)
            try:
                await self._store.write(name, count, order)
            except BaseException:
                self._lost(name, order)
                raise
            self._took(name, order, count)
        finally:
            self._writing.discard(name)
            if name in self._stale:
                self.publish(tenant)

    def _took(self, name: str, order: int, count: int) -> None:
        if order > self._written.get(name, (-1, 0))[0]:
            self._written[name] = (order, count)

    def _lost(self, name: str, order: int) -> None:
        """A call that failed may have reached Redis all the same: what it holds of this
        process is not known (-1) until a write answers."""
        self._took(name, order, _UNKNOWN)

    def _count(self, name: str) -> int:
        return self._written.get(name, (-1, 0))[1]

    def start(self) -> None:
        if self._task is None and self._tenants:
            self._task = asyncio.create_task(self._beat(), name="redis-tenant-slots")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            if not self._link.up:
                continue
            try:
                for tenant in self._tenants:
                    if tenant.in_flight or self._count(tenant.name):
                        self.publish(tenant, again=True)
            except Exception:  # the heartbeat must never stop
                log.exception("tenant slots heartbeat failed")
