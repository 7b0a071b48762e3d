"""Recent traffic: decaying request counts per backend, and each shared prompt's share.

Both answer "how much of the recent traffic went there", for the policy's hot checks and its
owner rule. Backend counts decay with time (a half-life in seconds); prompt shares decay per
request, so that live traffic and a replay in virtual time behave alike.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence

from gateway.clock import Clock

_RECENT_HALF_LIFE = 30.0
_SHARE_WINDOW = 256
"""Requests over which a shared prompt's share of the traffic is averaged (decay 1 - 1/W)."""
_SHARE_KEYS_MAX = 1 << 16


class RecentTraffic:
    """Exponentially decaying request counts per backend, and their decaying sum.

    Every count decays at the same rate, so the sum of the decayed counts is itself one
    decaying value: the mean over a model's candidates costs O(1) when every backend counted
    here is one of them (the common case, checked once per candidate group).
    """

    def __init__(self, clock: Clock, half_life: float = _RECENT_HALF_LIFE) -> None:
        self._clock = clock
        self._rate = math.log(2) / half_life
        self._counts: dict[str, tuple[float, float]] = {}
        self._total = (0.0, 0.0)
        self._within: tuple[frozenset[str], int] | None = None
        """A set of names known to hold every counted backend, and how many were counted."""
        self.view = RecentView(self)

    def get(self, name: str, default: float = 0.0) -> float:
        entry = self._counts.get(name)
        if entry is None:
            return default
        value, stamp = entry
        return value * math.exp(self._rate * (stamp - self._clock()))

    def snapshot(self, names: Sequence[str]) -> dict[str, float]:
        return {name: self.get(name) for name in names if name in self._counts}

    def sum_over(self, names: frozenset[str]) -> float:
        """The summed recent counts of `names`."""
        counted = len(self._counts)
        if self._within != (names, counted) and not self._counts.keys() <= names:
            return sum(self.get(name) for name in names)
        self._within = (names, counted)
        value, stamp = self._total
        return value * math.exp(self._rate * (stamp - self._clock()))

    def add(self, name: str) -> None:
        now = self._clock()
        rate = self._rate
        value, stamp = self._counts.get(name, (0.0, now))
        self._counts[name] = (value * math.exp(rate * (stamp - now)) + 1.0, now)
        total, since = self._total
        self._total = (total * math.exp(rate * (since - now)) + 1.0, now)


class RecentView(Mapping[str, float]):
    """`RecentTraffic` as a read-only mapping whose values decay as they are read."""

    __slots__ = ("_traffic",)

    def __init__(self, traffic: RecentTraffic) -> None:
        self._traffic = traffic

    def __getitem__(self, name: str) -> float:
        if name not in self._traffic._counts:
            raise KeyError(name)
        return self._traffic.get(name)

    def get(self, name: str, default: float = 0.0) -> float:  # type: ignore[override]
        return self._traffic.get(name, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self._traffic._counts)

    def __len__(self) -> int:
        return len(self._traffic._counts)


class PromptShares:
    """Each shared prompt's share of the recent requests, decayed per request, not per second.

    Counting in requests makes live traffic and replay in virtual time behave alike, and the
    share answers the question the owner rule asks: would this prompt alone fill more than one
    replica? Bounded: when full, the prompts counted longest ago are dropped first.
    """

    def __init__(self, window: int = _SHARE_WINDOW, max_keys: int = _SHARE_KEYS_MAX) -> None:
        self._keep = 1.0 - 1.0 / window
        self._max_keys = max_keys
        self._counts: dict[int, tuple[float, int]] = {}
        self._requests = 0
        self._total = 0.0

    def peek(self, key: int) -> float:
        """The share `add(key)` would give, counting nothing."""
        keep = self._keep
        total = self._total * keep + 1.0
        entry = self._counts.get(key)
        if entry is None:
            return 1.0 / total
        value, at = entry
        return (value * keep ** (self._requests + 1 - at) + 1.0) / total

    def add(self, key: int) -> float:
        """Count one request for `key`; its share of the recent requests, in [0, 1]."""
        self._requests += 1
        now = self._requests
        self._total = self._total * self._keep + 1.0
        counts = self._counts
        value, at = counts.pop(key, (0.0, now))
        value = value * self._keep ** (now - at) + 1.0
        counts[key] = (value, now)
        if len(counts) > self._max_keys:
            del counts[next(iter(counts))]
        return value / self._total


class Traffic:
    """What the router counts of every routed request: its backend, and its shared prompt.

    A request's shared prompt is everything before its first user message, counted only when
    it spans at least `min_shared_blocks` blocks (shorter ones are nobody's hot spot).
    """

    def __init__(self, clock: Clock, min_shared_blocks: int) -> None:
        self.recent = RecentTraffic(clock)
        self.shares = PromptShares()
        self._min_shared = min_shared_blocks

    def prompt_share(self, hashes: Sequence[int], private_from: int, count: bool) -> float:
        """The shared prompt's share of recent requests, this one included; `count`: record
        this request (`False` to ask what routing it would see)."""
        shared_end = min(private_from, len(hashes))
        if shared_end < self._min_shared:
            return 0.0
        key = hashes[shared_end - 1]
        return self.shares.add(key) if count else self.shares.peek(key)
