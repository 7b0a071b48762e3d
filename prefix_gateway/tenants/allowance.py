"""One of a tenant's limits per minute (requests or tokens) as one gateway process sees it.

The process charges its share of the limit in a bucket of its own (`local`): the whole limit
alone, 1/N with `--workers N`, or 1/(gateways last seen) while the fleet's shared bucket in
Redis is away. With Redis the fleet's bucket is charged instead, and its level as Redis last
reported it is kept (`fleet`): that is what the headers, the gauge and `/admin/tenants` show,
and the local bucket follows it (the same part of its own limit), so that a gateway losing
Redis goes on from where the fleet stood rather than from a full minute.
"""

from __future__ import annotations

from prefix_gateway.tenants.budget import MinuteBudget


class Allowance:
    __slots__ = ("_shared", "fleet", "limit", "local", "share")

    def __init__(self, limit: int, share: float, now: float, fleet_wide: bool = False) -> None:
        self.limit = limit
        """The tenant's whole limit per minute, as configured."""
        self.share = share
        """The part of `limit` the local bucket holds."""
        # A fleet-wide limit lets a charge larger than the share (but within the limit) in
        # once the share is whole: losing Redis must not make a request too large.
        ceiling = float(limit) if fleet_wide else None
        self.local = MinuteBudget(limit * share, now, ceiling)
        self.fleet = MinuteBudget(limit, now) if fleet_wide else None
        self._shared = False

    @property
    def shared(self) -> bool:
        """Whether the figures shown are the fleet's (Redis answered the last charge)."""
        return self._shared

    def take(self, amount: float, now: float) -> float:
        """Charge the local share: 0.0, or the seconds until `amount` fits (infinite: never)."""
        self._shared = False
        return self.local.take(amount, now)

    def give(self, amount: float, now: float) -> None:
        """Settle a local charge."""
        self.local.give(amount, now)

    def seen(self, level: float, now: float) -> None:
        """The fleet's level, as Redis answered a charge or a settlement."""
        if self.fleet is None:
            return
        self.fleet.set_level(level, now)
        self.local.set_level(level * self.share, now)
        self._shared = True

    def reshare(self, share: float, now: float) -> None:
        """A new share of the limit for the local bucket (the gateways seen changed)."""
        if share != self.share:
            self.local.resize(self.limit * share, now)
            self.share = share

    def remaining(self, now: float) -> int:
        """What remains of the tenant's whole limit: the fleet's, or the share's scaled up."""
        if self._shared and self.fleet is not None:
            return self.fleet.remaining(now)
        remaining = self.local.remaining(now)
        return remaining if self.share == 1.0 else round(remaining / self.share)

    def reset_seconds(self, now: float) -> float:
        """Seconds until the budget is whole again."""
        if self._shared and self.fleet is not None:
            return self.fleet.reset_seconds(now)
        return self.local.reset_seconds(now)
