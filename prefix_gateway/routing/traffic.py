"""Recent traffic: decaying request counts per backend, and each shared prompt's share.

Both answer "how much of the recent traffic went there", for the policy's hot check and its
owner rule, on one clock: every count halves each `recent_half_life` seconds of the clock the
caller injects (the monotonic clock in the gateway, a manual clock that the replay moves in
virtual time). In a fleet, the other gateways' counts are added as of their last exchange
(`set_fleet`), decaying from then on like this gateway's own, so every gateway sees the
fleet's traffic rather than its own share of it.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Generic, TypeVar

from prefix_gateway.clock import Clock
from prefix_gateway.config import Settings

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


class FleetCounts:
    """The other gateways' decaying counts as of their last exchange, decaying since."""

    def __init__(self, clock: Clock, half_life: float) -> None:
        self._clock = clock
        self._rate = math.log(2) / half_life
        self.counts: dict[str, float] = {}
        self.total = 0.0
        self._at = 0.0

    def set(self, counts: dict[str, float], total: float) -> None:
        self.counts, self.total, self._at = counts, total, self._clock()

    def decay(self) -> float:
        """The factor by which the counts set last have decayed since."""
        return math.exp(self._rate * (self._at - self._clock()))


class RecentTraffic(DecayingCounts[str]):
    """Decaying request counts per backend: this gateway's, plus the fleet's where exchanged.

    The mean over a model's candidates costs O(1) when every backend counted here is one of
    them (the common case, checked once per candidate group).
    """

    def __init__(self, clock: Clock, half_life: float) -> None:
        super().__init__(clock, half_life)
        self._within: tuple[frozenset[str], int] | None = None
        """A set of names known to hold every counted backend, and how many were counted."""
        self.fleet = FleetCounts(clock, half_life)
        self.view = RecentView(self)

    def get(self, key: str, default: float = 0.0) -> float:
        own = super().get(key, default)
        others = self.fleet.counts.get(key)
        return own if others is None else own + others * self.fleet.decay()

    def own_counts(self) -> dict[str, float]:
        return {name: super(RecentTraffic, self).get(name) for name in self._counts}

    def counted(self) -> Iterator[str]:
        yield from self._counts
        yield from (name for name in self.fleet.counts if name not in self._counts)

    def snapshot(self, names: Sequence[str]) -> dict[str, float]:
        return {name: self.get(name) for name in names if name in self._counts}

    def sum_over(self, names: frozenset[str]) -> float:
        """The summed recent counts of `names`."""
        counted = len(self._counts)
        fleet = self.fleet
        if self._within != (names, counted) and not self._counts.keys() <= names:
            return sum(self.get(name) for name in names)
        self._within = (names, counted)
        if fleet.counts and not fleet.counts.keys() <= names:
            return self.total() + sum(self.fleet.counts.get(name, 0.0) for name in names) * (
                fleet.decay()
            )
        return self.total() + fleet.total * fleet.decay()


class RecentView(Mapping[str, float]):
    """`RecentTraffic` as a read-only mapping whose values decay as they are read."""

    __slots__ = ("_traffic",)

    def __init__(self, traffic: RecentTraffic) -> None:
        self._traffic = traffic

    def __getitem__(self, name: str) -> float:
        traffic = self._traffic
        if name not in traffic._counts and name not in traffic.fleet.counts:
            raise KeyError(name)
        return traffic.get(name)

    def get(self, name: str, default: float = 0.0) -> float:  # type: ignore[override]
        return self._traffic.get(name, default)

    def __iter__(self) -> Iterator[str]:
        return self._traffic.counted()

    def __len__(self) -> int:
        return sum(1 for _ in self._traffic.counted())


class Traffic:
    """What the router counts of every routed request: its backend, and its shared prompt.

    A request's shared prompt is everything before its first user message, counted only when
    it spans at least the minimum match (shorter ones are nobody's hot spot). Its share of the
    recent requests answers the question the owner rule asks: would this prompt alone fill
    more than one replica? In a fleet, its count is the fleet's (kept in Redis) and the total
    the fleet's (exchanged).
    """

    def __init__(self, clock: Clock, settings: Settings) -> None:
        self.recent = RecentTraffic(clock, settings.recent_half_life)
        self.prompts = DecayingCounts[int](
            clock, settings.recent_half_life, settings.shared_prompts_max
        )
        self.fleet_prompts = FleetCounts(clock, settings.recent_half_life)
        self._min_shared = settings.min_match_blocks

    def shared_prompt(self, hashes: Sequence[int], private_from: int) -> int | None:
        """The last block of the request's shared prompt: its key, or None when it has none
        long enough to count."""
        shared_end = min(private_from, len(hashes))
        return hashes[shared_end - 1] if shared_end >= self._min_shared else None

    def prompt_share(
        self,
        hashes: Sequence[int],
        private_from: int,
        count: bool,
        fleet_count: float | None = None,
    ) -> float:
        """The shared prompt's share of recent requests, this one included, in (0, 1] (0 when
        it has none); `count`: record this request (`False` to ask what routing would see);
        `fleet_count`: the fleet's count of the prompt, this request included if counted."""
        key = self.shared_prompt(hashes, private_from)
        if key is None:
            return 0.0
        prompts = self.prompts
        own = prompts.add(key) if count else prompts.get(key) + 1.0
        total = prompts.total() + (0.0 if count else 1.0)
        if fleet_count is None:
            return own / total
        fleet = self.fleet_prompts
        total += fleet.total * fleet.decay()
        mine = max(fleet_count + (0.0 if count else 1.0), own)
        return min(1.0, mine / max(total, mine))

    def own(self) -> tuple[dict[str, float], float]:
        """What this gateway tells the fleet: its recent requests per backend, and how many
        recent requests carried a shared prompt."""
        return self.recent.own_counts(), self.prompts.total()

    def set_fleet(self, recent: dict[str, float], prompts_total: float) -> None:
        """The other gateways' counts, as just exchanged (empty when the exchange failed)."""
        self.recent.fleet.set(recent, sum(recent.values()))
        self.fleet_prompts.set({}, prompts_total)


def cold_prompt(share: float, candidates: int, load_factor: float) -> bool:
    """A shared prompt the owner rule keeps in one place: at most c / n of recent requests."""
    return share <= load_factor / max(1, candidates)
