"""Sticky sessions in Redis: `<ns>:s:<key hash>` = `"<unix ms> <backend>"`; stored responses'
replicas the same way under `<ns>:r:`.

The stamp lets the injected clock decide expiry as the in-memory store does; the key's Redis
TTL, restarted on every `put`, reclaims the memory.
"""

from __future__ import annotations

from collections.abc import Callable

from prefix_gateway.clock import Clock
from prefix_gateway.state.redis.connection import RedisClient
from prefix_gateway.state.redis.index import wall_clock
from prefix_gateway.state.redis.keys import KeySpace


class RedisSessionStore:
    def __init__(
        self,
        client: RedisClient,
        keys: KeySpace,
        ttl: float,
        clock: Clock = wall_clock,
        key_of: Callable[[KeySpace, str], str] = KeySpace.session,
    ) -> None:
        self._client = client
        self._keys = keys
        self._key_of = key_of
        self._ttl_ms = max(1, round(ttl * 1000))
        self._clock = clock

    async def get(self, key: str) -> str | None:
        value: bytes | None = await self._client.get(self._key_of(self._keys, key))
        if value is None:
            return None
        stamp, _, backend = value.decode().partition(" ")
        if round(self._clock() * 1000) - int(stamp) > self._ttl_ms:
            return None
        return backend

    async def put(self, key: str, backend: str) -> None:
        value = f"{round(self._clock() * 1000)} {backend}"
        await self._client.set(self._key_of(self._keys, key), value, px=self._ttl_ms)
