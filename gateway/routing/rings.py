"""A small cache of hash rings, one per set of candidates, so a ring is built once."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

from gateway.routing.ring import HashRing


class RingCache:
    def __init__(self, size: int = 64) -> None:
        self._size = size
        self._rings: OrderedDict[frozenset[str], HashRing] = OrderedDict()

    def get(self, candidates: Collection[str]) -> HashRing:
        """The ring of `candidates`; O(1) when given the pool's own frozenset of them (its hash
        is cached), O(n) for any other collection."""
        key = candidates if isinstance(candidates, frozenset) else frozenset(candidates)
        ring = self._rings.get(key)
        if ring is None:
            ring = self._rings[key] = HashRing(key)
            if len(self._rings) > self._size:
                self._rings.popitem(last=False)
        else:
            self._rings.move_to_end(key)
        return ring
