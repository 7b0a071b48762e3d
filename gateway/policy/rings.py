"""A small cache of hash rings, one per set of candidates, so a ring is built once."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from gateway.ring import HashRing


class RingCache:
    def __init__(self, size: int = 64) -> None:
        self._size = size
        self._rings: OrderedDict[tuple[str, ...], HashRing] = OrderedDict()

    def get(self, candidates: Sequence[str]) -> HashRing:
        key = tuple(candidates)
        ring = self._rings.get(key)
        if ring is None:
            ring = self._rings[key] = HashRing(key)
            if len(self._rings) > self._size:
                self._rings.popitem(last=False)
        else:
            self._rings.move_to_end(key)
        return ring
