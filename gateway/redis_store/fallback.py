"""Shared state that never fails a request: Redis when it answers in time, local state always.

Every write goes to the local store at once and to Redis in the background, so the local store
is warm whenever Redis goes away. A lookup asks Redis (bounded by the link's timeout) and takes,
per backend, the deeper of Redis's answer and the local one: Redis knows what every gateway
learned, the local store covers what Redis lost (a restart, an eviction, a write that was
dropped) since this gateway learned it. When Redis is down or slow the local answer alone is
used and the fallback is counted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from gateway.index import InMemoryPrefixIndex
from gateway.redis_store.connection import RedisLink, RedisUnavailable
from gateway.redis_store.index import RedisPrefixIndex
from gateway.redis_store.sessions import RedisSessionStore
from gateway.sessions import InMemorySessionStore


class FallbackPrefixIndex:
    def __init__(
        self, local: InMemoryPrefixIndex, shared: RedisPrefixIndex, link: RedisLink
    ) -> None:
        self.local = local
        self.shared = shared
        self._link = link

    def __len__(self) -> int:
        return len(self.local)

    async def match(self, model: str, hashes: Sequence[int]) -> dict[str, int]:
        if not hashes or not self._link.up:
            if hashes:
                self._link.fell_back("match")
            return await self.local.match(model, hashes)
        shared = asyncio.ensure_future(
            self._link.call("match", lambda: self.shared.match(model, hashes))
        )
        # One step lets the lookup reach the socket; the local match then runs during the round
        # trip instead of after it.
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            shared.cancel()
            raise
        local = await self.local.match(model, hashes)
        try:
            matched = await shared
        except RedisUnavailable:
            self._link.fell_back("match")
            return local
        for backend, depth in local.items():
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
