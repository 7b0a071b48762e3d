"""Recent traffic: decaying request counts per backend, and each shared prompt's share.

Both answer "how much of the recent traffic went there", for the policy's hot check and its
owner rule, on one clock: every count halves each `recent_half_life` seconds of the clock the
caller injects (the monotonic clock in the gateway, a manual clock that the replay moves in
virtual time).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Generic, TypeVar

from gateway.clock import Clock
from gateway.config import Settings

K = TypeVar("K", bound=Hashable)


class DecayingCounts(Generic[K]):
    """Counts per key that halve every `half_life` seconds, and their decaying sum.

    Every count decays at the same rate, so the sum of the decayed counts is itself one
    decaying value, read in O(1). With `max_keys`, the keys counted longest ago are dropped
    first once there are more.
    """

    def __init__(self, clock: Clock, half_life: float, max_keys: int | None = None) -> None:
        self._clock = clock
        self._rate = math.log(2) / half_life
        self._max_keys = max_keys
        # Ordered by last count, oldest first: dropping the oldest stays O(1) (a plain dict's
        # first entry, deleted again and again, makes each next look-up walk the dead slots).
        self._counts: OrderedDict[K, tuple[float, float]] = OrderedDict()
        self._total = (0.0, 0.0)

    def get(self, key: K, default: float = 0.0) -> float:
        entry = self._counts.get(key)
        if entry is None:
            return default
        return self._decayed(entry, self._clock())

    def total(self) -> float:
        """The sum of every key's count."""
        return self._decayed(self._total, self._clock())

    def add(self, key: K) -> float:
        """Count one for `key`; its count now."""
        now = self._clock()
        counts = self._counts
        entry = counts.pop(key, None)
        value = (self._decayed(entry, now) if entry is not None else 0.0) + 1.0
        counts[key] = (value, now)
        self._total = (self._decayed(self._total, now) + 1.0, now)
        if self._max_keys is not None and len(counts) > self._max_keys:
            counts.popitem(last=False)
        return value

    def forget(self, key: K) -> None:
        """Drop `key` (a backend that left), and its count from the sum."""
        entry = self._counts.pop(key, None)
        if entry is not None:
            now = self._clock()
            self._total = (
                max(0.0, self._decayed(self._total, now) - self._decayed(entry, now)),
                now,
            )

    def _decayed(self, entry: tuple[float, float], now: float) -> float:
        value, stamp = entry
        return value * math.exp(self._rate * (stamp - now))


class RecentTraffic(DecayingCounts[str]):
    """Decaying request counts per backend.

    The mean over a model's candidates costs O(1) when every backend counted here is one of
    them (the common case, checked once per candidate group).
    """

    def __init__(self, clock: Clock, half_life: float) -> None:
        super().__init__(clock, half_life)
        self._within: tuple[frozenset[str], int] | None = None
        """A set of names known to hold every counted backend, and how many were counted."""
        self.view = RecentView(self)

    def snapshot(self, names: Sequence[str]) -> dict[str, float]:
        return {name: self.get(name) for name in names if name in self._counts}

    def sum_over(self, names: frozenset[str]) -> float:
        """The summed recent counts of `names`."""
        counted = len(self._counts)
        if self._within != (names, counted) and not self._counts.keys() <= names:
            return sum(self.get(name) for name in names)
        self._within = (names, counted)
        return self.total()


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


class Traffic:
    """What the router counts of every routed request: its backend, and its shared prompt.

    A request's shared prompt is everything before its first user message, counted only when
    it spans at least the minimum match (shorter ones are nobody's hot spot). Its share of the
    recent requests answers the question the owner rule asks: would this prompt alone fill
    more than one replica?
    """

    def __init__(self, clock: Clock, settings: Settings) -> None:
        self.recent = RecentTraffic(clock, settings.recent_half_life)
        self.prompts = DecayingCounts[int](
            clock, settings.recent_half_life, settings.shared_prompts_max
        )
        self._min_shared = settings.min_match_blocks

    def prompt_share(self, hashes: Sequence[int], private_from: int, count: bool) -> float:
        """The shared prompt's share of recent requests, this one included, in (0, 1] (0 when
        it has none); `count`: record this request (`False` to ask what routing would see)."""
        shared_end = min(private_from, len(hashes))
        if shared_end < self._min_shared:
            return 0.0
        key = hashes[shared_end - 1]
        prompts = self.prompts
        if count:
            return prompts.add(key) / prompts.total()
        return (prompts.get(key) + 1.0) / (prompts.total() + 1.0)
