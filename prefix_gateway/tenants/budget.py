"""A budget per minute: a bucket that holds at most `limit` units and refills at `limit` per
60 s, continuously, so a tenant that used its minute gets a little back every moment instead
of everything at the turn of the minute. A charge is taken whole or not at all; a settled
charge gives back what was estimated too high, or takes what was estimated too low (the level
may then go below zero, and the next charges wait for it).

A bucket that holds a share of a larger limit (a gateway's part of its fleet's) may be given
that limit as its `ceiling`: a charge above the bucket's own limit but within the ceiling is
then taken once the bucket is full, leaving it in debt, rather than refused as too large.
"""

from __future__ import annotations

import math

MINUTE = 60.0


class MinuteBudget:
    __slots__ = ("_ceiling", "_level", "_rate", "_updated", "limit")

    def __init__(self, limit: float, now: float, ceiling: float | None = None) -> None:
        self.limit = limit
        self._rate = limit / MINUTE
        self._level = float(limit)
        self._updated = now
        self._ceiling = ceiling

    def take(self, amount: float, now: float) -> float:
        """Take `amount` if it is there: 0.0; else the seconds until it would be (infinite
        for more than the ceiling, or the limit without one)."""
        if amount > max(self.limit, self._ceiling or 0.0):
            return math.inf
        level = self._refilled(now)
        if amount <= level or (amount > self.limit and level >= self.limit):
            self._level = level - amount
            return 0.0
        return (min(amount, self.limit) - level) / self._rate

    def give(self, amount: float, now: float) -> None:
        """Settle a charge: `amount` back (or, negative, more taken)."""
        self._level = min(float(self.limit), self._refilled(now) + amount)

    def set_level(self, level: float, now: float) -> None:
        """The level as someone who keeps the same bucket elsewhere reported it."""
        self._level = min(float(self.limit), level)
        self._updated = now

    def resize(self, limit: float, now: float) -> None:
        """A new limit; the level keeps its part of the whole (a bucket half full stays so)."""
        level = self._refilled(now)
        self._level = level * limit / self.limit
        self.limit = limit
        self._rate = limit / MINUTE

    def remaining(self, now: float) -> int:
        return max(0, math.floor(self._refilled(now)))

    def reset_seconds(self, now: float) -> float:
        """Seconds until the budget is whole again."""
        return (self.limit - self._refilled(now)) / self._rate

    def _refilled(self, now: float) -> float:
        level = min(float(self.limit), self._level + (now - self._updated) * self._rate)
        self._level = level
        self._updated = now
        return level


def duration_text(seconds: float) -> str:
    """A duration as OpenAI's `x-ratelimit-reset-*` headers write it: `20ms`, `1.5s`, `6m0s`."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    minutes, rest = divmod(seconds, 60)
    rest = math.floor(rest * 10) / 10
    text = f"{rest:g}s"
    return f"{int(minutes)}m{text}" if minutes else text
