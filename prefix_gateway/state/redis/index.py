"""The prefix index in Redis, shared by every gateway: the contract of `InMemoryPrefixIndex`,
one script call per operation, bounded by `maxmemory`, stamps rounded to `refresh` seconds so
a next turn rewrites only its new blocks (docs/redis.md).
"""

from __future__ import annotations

import struct
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import cast

from redis.asyncio import Redis

from prefix_gateway.clock import Clock
from prefix_gateway.state.redis.connection import RedisClient
from prefix_gateway.state.redis.keys import HASH_BYTES, KeySpace
from prefix_gateway.state.redis.scripts import FORGET_SCRIPT, MATCH_SCRIPT, RECORD_SCRIPT

# Chains whose first block this process has seen, so that `forget` (given only the deeper
# part of a chain) finds the hash tag its keys live under.
_KNOWN_CHAINS = 65_536
# Block keys one script call writes or deletes at most: a long prompt's write is several short
# calls, so that no gateway's lookup waits long behind it.
BLOCKS_PER_CALL = 512


def wall_clock() -> float:
    return time.time()


def pack_hashes(hashes: Sequence[int]) -> bytes:
    """The block hashes as 8 big-endian bytes each: the way key names spell them."""
    return struct.pack(f">{len(hashes)}Q", *hashes)


class RedisPrefixIndex:
    def __init__(
        self,
        client: RedisClient,
        keys: KeySpace,
        ttl: float,
        clock: Clock = wall_clock,
        refresh: float | None = None,
    ) -> None:
        self._keys = keys
        self._ttl_ms = max(1, round(ttl * 1000))
        self._refresh_ms = round((ttl / 20 if refresh is None else refresh) * 1000)
        self._clock = clock
        # AsyncScript serves both clients; redis-py types its `register_script` for Redis only.
        scripts = cast(Redis, client)
        self._match = scripts.register_script(MATCH_SCRIPT)
        self._record = scripts.register_script(RECORD_SCRIPT)
        self._forget = scripts.register_script(FORGET_SCRIPT)
        # (model, last block hash of a chain) -> the chain's first block hash
        self._first_blocks: OrderedDict[tuple[str, int], int] = OrderedDict()

    async def match(self, model: str, hashes: Sequence[int]) -> dict[str, int]:
        if not hashes:
            return {}
        self._remember_chain(model, hashes)
        prefix = self._keys.block_prefix(model, hashes[0])
        packed = pack_hashes(hashes)
        oldest = self._now_ms() - self._ttl_ms
        reply = await self._match([prefix + packed[:HASH_BYTES]], [prefix, packed, oldest])
        return {
            reply[position].decode(): int(reply[position + 1])
            for position in range(0, len(reply), 2)
        }

    async def record(self, model: str, backend: str, hashes: Sequence[int]) -> None:
        if not hashes:
            return
        if " " in backend or "\n" in backend:
            raise ValueError(f"backend name {backend!r} holds a space or a newline")
        self._remember_chain(model, hashes)
        prefix = self._keys.block_prefix(model, hashes[0])
        packed = pack_hashes(hashes)
        now = self._now_ms()
        refresh, ttl = self._refresh_ms, self._ttl_ms
        stamp = now - now % refresh if refresh > 0 else now
        # A key lives a refresh period longer than its newest entry counts, less up to that
        # period for its depth, so that eviction by TTL cuts a chain from its end.
        first_key = [prefix + packed[:HASH_BYTES]]
        # Ever longer prefixes of the chain: each call finds the blocks already written in
        # O(log n) reads and writes at most BLOCKS_PER_CALL more, keeping stamps prefix-closed.
        for end in range(BLOCKS_PER_CALL, len(hashes) + BLOCKS_PER_CALL, BLOCKS_PER_CALL):
            chunk = packed[: min(end, len(hashes)) * HASH_BYTES]
            await self._record(
                first_key,
                [prefix, chunk, backend, stamp, now - ttl, ttl + refresh, now, refresh],
            )

    def share(self, model: str, backend: str, hashes: Sequence[int]) -> None:
        return None  # what it records is shared already

    async def publish(self, model: str, backend: str, hashes: Sequence[int]) -> None:
        await self.record(model, backend, hashes)

    async def forget(self, model: str, backend: str, hashes: Sequence[int]) -> None:
        if not hashes:
            return
        first_block = self._first_block(model, hashes)
        prefix = self._keys.block_prefix(model, first_block)
        width = len(prefix) + HASH_BYTES
        # Deepest first, so that what stays of a chain between calls is still its prefix.
        for start in reversed(range(0, len(hashes), BLOCKS_PER_CALL)):
            names = self._keys.block_keys(prefix, hashes[start : start + BLOCKS_PER_CALL])
            await self._forget([names[:width]], [names, width, backend])

    def _now_ms(self) -> int:
        return round(self._clock() * 1000)

    def _remember_chain(self, model: str, hashes: Sequence[int]) -> None:
        chains = self._first_blocks
        key = (model, hashes[-1])
        chains[key] = hashes[0]
        chains.move_to_end(key)
        if len(chains) > _KNOWN_CHAINS:
            chains.popitem(last=False)

    def _first_block(self, model: str, hashes: Sequence[int]) -> int:
        """The first block of the chain `hashes` belongs to (a chain starts at its own root)."""
        chains = self._first_blocks
        for block in reversed(hashes):
            first_block = chains.get((model, block))
            if first_block is not None:
                return first_block
        return hashes[0]
