"""Tenants' budgets per minute shared by the gateways of a fleet through Redis
(docs/tenants.md, budgets across a fleet).

A charge is one script call that takes the request and its estimated tokens from the fleet's
buckets, all or nothing, within `--redis-timeout`. When Redis does not answer in time (or is
known to be away) the charge goes to this process's share of each limit instead — the limit
divided by the gateway processes the exchange of loads last saw (each worker counts), or by its
workers before it saw any — and is counted in `gateway_redis_fallbacks_total{operation=
"budget_take"}`: no request waits longer for Redis, none fails for it. A charge settles where
it was taken: in Redis in the background (a bounded queue, as other writes), else locally.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prefix_gateway.state.redis.budgets import BudgetAmount, BudgetReply, RedisBudgets
from prefix_gateway.state.redis.connection import RedisLink, RedisUnavailable
from prefix_gateway.tenants.tenant import Reservation, Tenant


class SharedBudgets:
    def __init__(
        self,
        store: RedisBudgets,
        link: RedisLink,
        gateways: Callable[[], int | None],
        workers: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`gateways`: the gateway processes of the fleet last seen (None: not known yet)."""
        self._store = store
        self._link = link
        self._gateways = gateways
        self._workers = workers
        self._clock = clock

    def share(self) -> float:
        """This process's part of a limit while Redis is away."""
        return 1.0 / max(1, self._gateways() or self._workers)

    async def take(self, tenant: Tenant, estimate: float) -> Reservation:
        """Reserve a request and about `estimate` tokens in the fleet's budgets; a
        `TenantRefused` if they do not fit there (or, Redis away, in this process's share)."""
        amounts = [
            BudgetAmount(kind, allowance.limit, 1.0 if kind == "requests" else estimate)
            for kind, allowance in tenant.allowances
        ]
        store = self._store
        # The share kept current, so the local bucket follows the fleet's in the right part.
        tenant.reshare(self.share(), self._clock())
        try:
            reply = await self._link.call("budget_take", lambda: store.take(tenant.name, amounts))
        except RedisUnavailable:
            self._link.fell_back("budget_take")
            return Reservation(tenant, tenant.take(estimate, self._clock()))
        now = self._clock()
        _saw(tenant, amounts, reply, now)
        if not reply.done:
            # The longest wait names the limit (a charge that never fits waits forever).
            longest = max(range(len(amounts)), key=lambda position: reply.waits[position])
            raise tenant.over(amounts[longest].kind, reply.waits[longest], estimate, now)
        return Reservation(tenant, estimate if tenant.tokens is not None else 0.0, shared=True)

    def give(self, tenant: Tenant, tokens: float, seen: Callable[[Tenant], None]) -> None:
        """Settle a charge taken in Redis: `tokens` back (negative: more taken), in the
        background, then `seen(tenant)` with the fleet's figures; a settlement Redis cannot
        take is lost, and counted."""
        if tenant.tokens is None:
            return
        amounts = [BudgetAmount("tokens", tenant.tokens.limit, tokens)]
        store = self._store

        async def settle() -> None:
            reply = await store.give(tenant.name, amounts)
            _saw(tenant, amounts, reply, self._clock())
            seen(tenant)

        self._link.submit("budget_settle", settle)


def _saw(tenant: Tenant, amounts: list[BudgetAmount], reply: BudgetReply, now: float) -> None:
    """The fleet's levels, as Redis answered for `amounts`."""
    allowances = dict(tenant.allowances)
    for amount, level in zip(amounts, reply.levels, strict=True):
        allowances[amount.kind].seen(level, now)
