"""Shared state that never fails a request: Redis when it answers in time, local state always.

Every write goes to the local store at once and to Redis in the background, so the local store
is warm whenever Redis goes away. A lookup asks Redis (bounded by the link's timeout); when
Redis is down or slow the local answer alone is used and the fallback is counted.

Redis knows what every gateway learned; it may lack what this gateway learned if a write of
ours was lost — Redis was away (and may have restarted empty), or a write failed or was dropped.
For one TTL after such a loss a lookup takes, per backend, the deeper of Redis's answer and the
local one. Otherwise Redis's answer stands alone, and the local match is not paid for.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.index import InMemoryPrefixIndex
from gateway.redis_store.connection import RedisLink, RedisUnavailable
from gateway.redis_store.index import RedisPrefixIndex
from gateway.redis_store.sessions import RedisSessionStore
from gateway.sessions import InMemorySessionStore


class FallbackPrefixIndex:
    def __init__(
        self, local: InMemoryPrefixIndex, shared: RedisPrefixIndex, link: RedisLink, ttl: float
    ) -> None:
        self.local = local
        self.shared = shared
        self._link = link
        self._ttl = ttl

    def __len__(self) -> int:
        return len(self.local)

    async def match(self, model: str, hashes: Sequence[int]) -> dict[str, int]:
        if not hashes:
            return {}
        try:
            matched = await self._link.call("match", lambda: self.shared.match(model, hashes))
        except RedisUnavailable:
            self._link.fell_back("match")
            return await self.local.match(model, hashes)
        if self._link.seconds_since_lost_write() < self._ttl:
            for backend, depth in (await self.local.match(model, hashes)).items():
                if depth > matched.get(backend, 0):
                    matched[backend] = depth
        return matched

    async def record(self, model: str, backend: str, hashes: Sequence[int]) -> None:
        await self.local.record(model, backend, hashes)
        if hashes:
            self._link.submit("record", lambda: self.shared.record(model, backend, hashes))

    async def forget(self, model: str, backend: str, hashes: Sequence[int]) -> None:
        await self.local.forget(model, backend, hashes)
        if hashes:
            self._link.submit("forget", lambda: self.shared.forget(model, backend, hashes))


class FallbackSessionStore:
    def __init__(
        self, local: InMemorySessionStore, shared: RedisSessionStore, link: RedisLink
    ) -> None:
        self.local = local
        self.shared = shared
        self._link = link

    def __len__(self) -> int:
        return len(self.local)

    async def get(self, key: str) -> str | None:
        local = await self.local.get(key)
        try:
            shared = await self._link.call("session_get", lambda: self.shared.get(key))
        except RedisUnavailable:
            self._link.fell_back("session_get")
            return local
        return shared if shared is not None else local

    async def put(self, key: str, backend: str) -> None:
        await self.local.put(key, backend)
        self._link.submit("session_put", lambda: self.shared.put(key, backend))
