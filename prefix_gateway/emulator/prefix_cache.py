"""A block-level prefix cache with vLLM's arithmetic, free of I/O and clocks.

Full blocks only, named by chained hashes; a hit is the longest cached run of leading blocks,
leaving the last prompt token to compute. Admission pins the cached blocks and reserves every
block the sequence will hold, or refuses; freed blocks join the LRU tail last block first, so
a chain loses its tail before its head. Lookup and admission are O(prompt blocks), eviction
O(1) a block.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

_ROOT_HASH = 0


def block_hashes(
    token_ids: Sequence[int], block_size: int, known: Sequence[int] = (), salt: str | None = None
) -> list[int]:
    """Chained hashes of the full blocks of `token_ids`; `known` are those already computed.
    A `salt` (vLLM's `cache_salt`) goes into the first block's hash, so that only requests
    with the same salt share cached blocks."""
    hashes = list(known)
    full_blocks = len(token_ids) // block_size
    if len(hashes) >= full_blocks:
        return hashes[:full_blocks]
    start = len(hashes) * block_size
    data = memoryview(array("I", token_ids[start : full_blocks * block_size]).tobytes())
    step = block_size * 4
    parent = hashes[-1] if hashes else _root(salt)
    for offset in range(0, len(data), step):
        parent = xxhash.xxh3_64_intdigest(data[offset : offset + step], seed=parent)
        hashes.append(parent)
    return hashes


def _root(salt: str | None) -> int:
    return _ROOT_HASH if salt is None else xxhash.xxh3_64_intdigest(salt.encode())


@dataclass
class CacheLease:
    """The blocks one sequence holds while it runs."""

    cached_tokens: int
    pinned: list[int] = field(default_factory=list)
    anonymous_blocks: int = 0
    covered_blocks: int = 0
    computing: list[int] = field(default_factory=list)
    """The prompt's blocks this sequence computes, until its prefill publishes them."""


class PrefixCache:
    def __init__(self, capacity_blocks: int, block_size: int) -> None:
        if capacity_blocks < 1 or block_size < 1:
            raise ValueError("capacity_blocks and block_size must be at least 1")
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self.queries = 0
        self.hits = 0
        self.in_flight_misses = 0
        """Admissions whose first uncached block another running sequence was computing:
        computed twice, where arriving after that prefill would have hit."""
        self._computing: dict[int, int] = {}
        self._refs: dict[int, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._anonymous = 0

    @property
    def cached_blocks(self) -> int:
        """Blocks with reusable content, pinned or not."""
        return len(self._refs)

    @property
    def used_blocks(self) -> int:
        """Blocks holding KV: cached ones, pinned or not, and those private to a sequence."""
        return len(self._refs) + self._anonymous

    @property
    def pinned_blocks(self) -> int:
        return len(self._refs) - len(self._evictable) + self._anonymous

    @property
    def free_blocks(self) -> int:
        """Blocks an admission may take: empty ones and evictable cached ones."""
        return self.capacity_blocks - self.pinned_blocks

    @property
    def usage(self) -> float:
        return self.pinned_blocks / self.capacity_blocks

    def sequence_blocks(self, prompt_tokens: int, max_tokens: int) -> int:
        """Blocks a sequence holds at its longest: the KV of all but its last generated token."""
        held_tokens = prompt_tokens + max(max_tokens, 1) - 1
        return -(-held_tokens // self.block_size)

    def lookup(self, hashes: Sequence[int]) -> int:
        """Leading blocks of `hashes` present in the cache."""
        refs = self._refs
        for index, block in enumerate(hashes):
            if block not in refs:
                return index
        return len(hashes)

    def hit_blocks(self, hashes: Sequence[int], prompt_tokens: int) -> int:
        """Blocks reused by a prompt: its cached leading blocks, leaving one token to compute."""
        return min(self.lookup(hashes), (prompt_tokens - 1) // self.block_size)

    def admit(
        self, hashes: Sequence[int], prompt_tokens: int, max_tokens: int
    ) -> CacheLease | None:
        """Pin the prompt's cached blocks and reserve the rest, or None if they do not fit."""
        if prompt_tokens < 1:
            raise ValueError("a prompt has at least one token")
        hit_blocks = self.hit_blocks(hashes, prompt_tokens)
        new_blocks = self.sequence_blocks(prompt_tokens, max_tokens) - hit_blocks
        refs = self._refs
        reused_evictable = sum(1 for block in hashes[:hit_blocks] if refs[block] == 0)
        if new_blocks > self.free_blocks - reused_evictable:
            return None
        for block in hashes[:hit_blocks]:
            count = refs[block]
            if count == 0:
                del self._evictable[block]
            refs[block] = count + 1
        while self.capacity_blocks - len(refs) - self._anonymous < new_blocks:
            evicted, _ = self._evictable.popitem(last=False)
            del refs[evicted]
        self._anonymous += new_blocks
        cached_tokens = hit_blocks * self.block_size
        self.queries += prompt_tokens
        self.hits += cached_tokens
        computing = self._computing
        uncached = [block for block in hashes[hit_blocks:] if block not in refs]
        if uncached and uncached[0] in computing:
            self.in_flight_misses += 1
        for block in uncached:
            computing[block] = computing.get(block, 0) + 1
        return CacheLease(
            cached_tokens=cached_tokens,
            pinned=list(hashes[:hit_blocks]),
            anonymous_blocks=new_blocks,
            covered_blocks=hit_blocks,
            computing=uncached,
        )

    def publish(self, lease: CacheLease, hashes: Sequence[int]) -> None:
        """Make a sequence's computed full blocks reusable; one already cached (computed twice
        at once) stays private to the sequence and is freed with it."""
        self._computed(lease)
        refs = self._refs
        for index in range(lease.covered_blocks, len(hashes)):
            if lease.anonymous_blocks == 0:
                break
            lease.covered_blocks = index + 1
            block = hashes[index]
            if block in refs:
                continue
            refs[block] = 1
            lease.pinned.append(block)
            lease.anonymous_blocks -= 1
            self._anonymous -= 1

    def release(self, lease: CacheLease) -> None:
        """Unpin a finished sequence's blocks; its cached ones become evictable."""
        self._computed(lease)
        refs = self._refs
        for block in reversed(lease.pinned):
            count = refs[block] - 1
            refs[block] = count
            if count == 0:
                self._evictable[block] = None
        self._anonymous -= lease.anonymous_blocks
        lease.pinned = []
        lease.anonymous_blocks = 0

    def _computed(self, lease: CacheLease) -> None:
        """The lease's prefill is over (published, or given up): none of its blocks is
        being computed for it any more."""
        computing = self._computing
        for block in lease.computing:
            left = computing[block] - 1
            if left:
                computing[block] = left
            else:
                del computing[block]
        lease.computing = []
