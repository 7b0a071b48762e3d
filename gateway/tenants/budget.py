"""A budget per minute: a bucket that holds at most `limit` units and refills at `limit` per
60 s, continuously, so a tenant that used its minute gets a little back every moment instead
of everything at the turn of the minute. A charge is taken whole or not at all; a settled
charge gives back what was estimated too high, or takes what was estimated too low (the level
may then go below zero, and the next charges wait for it)."""

from __future__ import annotations

import math

MINUTE = 60.0


class MinuteBudget:
    __slots__ = ("_level", "_rate", "_updated", "limit")

    def __init__(self, limit: float, now: float) -> None:
        self.limit = limit
        self._rate = limit / MINUTE
        self._level = float(limit)
        self._updated = now

    def take(self, amount: float, now: float) -> float:
        """Take `amount` if it is there: 0.0; else the seconds until it would be (infinite
        for more than the whole limit)."""
        level = self._refilled(now)
        if amount <= level:
            self._level = level - amount
            return 0.0
        if amount > self.limit:
            return math.inf
        return (amount - level) / self._rate

    def give(self, amount: float, now: float) -> None:
        """Settle a charge: `amount` back (or, negative, more taken)."""
        self._level = min(float(self.limit), self._refilled(now) + amount)

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
