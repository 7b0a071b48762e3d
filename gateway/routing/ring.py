"""Consistent hashing with bounded loads.

Each backend owns `vnodes` points on a 64-bit ring. A key walks clockwise from its point and
takes the first backend whose load is within the bound; a backend joining or leaving moves only
the keys whose walk passes its points, about 1/n of them. Lookup is a binary search:
O(log(n·vnodes)) to start, then O(1) a step.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Iterator

import xxhash

DEFAULT_VNODES = 160


def load_bound(total_load: int, backends: int, factor: float, floor: int) -> int:
    """The most load one backend may carry once the request being placed is counted.

    `ceil(factor * (total_load + 1) / backends)`, but never below `floor`: with little in
    flight the plain bound is below 1 and would move requests away from their cache for no
    gain.
    """
    if backends <= 0:
        return floor
    return max(floor, math.ceil(factor * (total_load + 1) / backends))


def within_bound(load: int, bound: int) -> bool:
    """Whether a backend carrying `load` may take one more request."""
    return load + 1 <= bound


class HashRing:
    def __init__(self, names: Iterable[str], vnodes: int = DEFAULT_VNODES) -> None:
        self.names = tuple(sorted(set(names)))
        points: list[tuple[int, str]] = []
        for name in self.names:
            for replica in range(vnodes):
                points.append((xxhash.xxh3_64_intdigest(f"{name}#{replica}"), name))
        points.sort()
        self._points = [point for point, _ in points]
        self._owners = [owner for _, owner in points]

    def walk(self, key: int) -> Iterator[str]:
        """Every backend once, in clockwise order from `key`."""
        if not self._points:
            return
        seen: set[str] = set()
        count = len(self._points)
        start = bisect.bisect_left(self._points, key)
        for step in range(count):
            owner = self._owners[(start + step) % count]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == len(self.names):
                    return

    def owner(self, key: int) -> str | None:
        return next(self.walk(key), None)
