"""The prefix index: which backends were sent which prefix blocks.

Every backend sent a block is remembered, each with its own matched depth. Records cover whole
prefixes, and eviction (TTL of disuse, least recently touched first, deepest first) and
`forget` cut from the end, so holding is monotone along a chain: `match` binary-searches each
backend's depth, O(holders · log blocks).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from prefix_gateway.clock import Clock, monotonic


class PrefixIndex(Protocol):
    async def match(self, model: str, hashes: Sequence[int]) -> dict[str, int]:
        """Matched depth in blocks for every backend holding at least the first block."""
        ...

    async def record(self, model: str, backend: str, hashes: Sequence[int]) -> None:
        """Remember that `backend` was sent (or now holds) every block of `hashes`, here."""
        ...

    def share(self, model: str, backend: str, hashes: Sequence[int]) -> None:
        """Tell the other gateways too, in the background (the request was routed there)."""
        ...

    async def publish(self, model: str, backend: str, hashes: Sequence[int]) -> None:
        """Record, and return once the other gateways see it too (or could not be told)."""
        ...

    async def forget(self, model: str, backend: str, hashes: Sequence[int]) -> None:
        """`backend` no longer holds these blocks (its cache evicted them)."""
        ...


_NEVER = float("-inf")


class InMemoryPrefixIndex:
    def __init__(self, ttl: float, max_blocks: int, clock: Clock = monotonic) -> None:
        self._ttl = ttl
        self._max_blocks = max_blocks
        self._clock = clock
        # (model, block hash) -> {backend: last touched}; ordered by last touch, oldest first.
        self._blocks: OrderedDict[tuple[str, int], dict[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    async def match(self, model: str, hashes: Sequence[int]) -> dict[str, int]:
        # Binary search per backend: holding is monotone along a chain (see the module).
        if not hashes:
            return {}
        blocks = self._blocks
        root = blocks.get((model, hashes[0]))
        if root is None:
            return {}
        oldest = self._clock() - self._ttl
        last = len(hashes) - 1
        depths: dict[str, int] = {}
        for backend, touched in root.items():
            if touched < oldest:
                continue
            low, high = 0, last
            while low < high:
                middle = (low + high + 1) // 2
                holders = blocks.get((model, hashes[middle]))
                if holders is not None and holders.get(backend, _NEVER) >= oldest:
                    low = middle
                else:
                    high = middle - 1
            depths[backend] = low + 1
        return depths

    async def record(self, model: str, backend: str, hashes: Sequence[int]) -> None:
        now = self._clock()
        blocks = self._blocks
        # Deepest first, so that the beginning of the prompt is the most recently touched.
        for block in reversed(hashes):
            key = (model, block)
            holders = blocks.get(key)
            if holders is None:
                blocks[key] = {backend: now}
            else:
                holders[backend] = now
                blocks.move_to_end(key)
        self._trim(now)

    def share(self, model: str, backend: str, hashes: Sequence[int]) -> None:
        return None  # nothing beyond this process to tell

    async def publish(self, model: str, backend: str, hashes: Sequence[int]) -> None:
        await self.record(model, backend, hashes)

    async def forget(self, model: str, backend: str, hashes: Sequence[int]) -> None:
        for block in hashes:
            holders = self._blocks.get((model, block))
            if holders is not None and holders.pop(backend, None) is not None and not holders:
                del self._blocks[(model, block)]

    def _trim(self, now: float) -> None:
        blocks = self._blocks
        while len(blocks) > self._max_blocks:
            blocks.popitem(last=False)
        oldest = now - self._ttl
        while blocks:
            _key, holders = next(iter(blocks.items()))
            if max(holders.values()) >= oldest:
                break
            blocks.popitem(last=False)
