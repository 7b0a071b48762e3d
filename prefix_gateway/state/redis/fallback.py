"""Shared state that never fails a request: Redis when it answers in time, local state always
(docs/redis.md, failure behaviour). Forgets go out in batches, so a burst never takes the
slots the prompts' own writes need.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from prefix_gateway.state.index import InMemoryPrefixIndex
from prefix_gateway.state.redis.connection import RedisLink, RedisUnavailable
from prefix_gateway.state.redis.index import RedisPrefixIndex
from prefix_gateway.state.redis.sessions import RedisSessionStore
from prefix_gateway.state.sessions import InMemorySessionStore

# Forgets waiting for Redis at most; beyond, one is dropped (and counted as a fallback).
_FORGETS_WAITING = 4096
# Forgets per background write: few enough to finish within the write deadline.
_FORGETS_PER_WRITE = 32


class FallbackPrefixIndex:
    def __init__(
        self, local: InMemoryPrefixIndex, shared: RedisPrefixIndex, link: RedisLink, ttl: float
    ) -> None:
        self.local = local
        self.shared = shared
        self._link = link
        self._ttl = ttl
        self._forgets: deque[tuple[str, str, Sequence[int]]] = deque()
        self._forgetting = False

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

    def share(self, model: str, backend: str, hashes: Sequence[int]) -> None:
        if hashes:
            self._link.submit("record", lambda: self.shared.record(model, backend, hashes))

    async def publish(self, model: str, backend: str, hashes: Sequence[int]) -> None:
        await self.local.record(model, backend, hashes)
        if hashes:
            written = self.shared.record
            await self._link.write_soon("record", lambda: written(model, backend, hashes))

    async def forget(self, model: str, backend: str, hashes: Sequence[int]) -> None:
        await self.local.forget(model, backend, hashes)
        if not hashes:
            return
        if len(self._forgets) >= _FORGETS_WAITING:
            self._link.fell_back("forget")
            return
        self._forgets.append((model, backend, hashes))
        if not self._forgetting:
            self._submit_forgets()

    def _submit_forgets(self) -> None:
        self._forgetting = self._link.submit("forget", self._forget_waiting)
        if not self._forgetting:
            self._forgets.clear()

    async def _forget_waiting(self) -> None:
        done = False
        try:
            for _ in range(min(_FORGETS_PER_WRITE, len(self._forgets))):
                await self.shared.forget(*self._forgets[0])
                self._forgets.popleft()
            done = True
        finally:
            if done and self._forgets:
                self._submit_forgets()
            else:
                # Whatever a failed write left is lost: the link counted it.
                self._forgets.clear()
                self._forgetting = False


class FallbackSessionStore:
    """Sessions, or (`name="response"`) the replicas of stored responses, which are `patient`:
    a miss there fails the request rather than slowing it, so a lookup waits for Redis up to
    a write's deadline and a `put` is awaited (a client may name a response at another gateway
    as soon as it has it)."""

    def __init__(
        self,
        local: InMemorySessionStore,
        shared: RedisSessionStore,
        link: RedisLink,
        name: str = "session",
        patient: bool = False,
    ) -> None:
        self.local = local
        self.shared = shared
        self._link = link
        self._get = f"{name}_get"
        self._put = f"{name}_put"
        self._patient = patient

    def __len__(self) -> int:
        return len(self.local)

    async def get(self, key: str) -> str | None:
        local = await self.local.get(key)
        try:
            deadline = self._link.write_timeout if self._patient else None
            shared = await self._link.call(self._get, lambda: self.shared.get(key), deadline)
        except RedisUnavailable:
            self._link.fell_back(self._get)
            return local
        return shared if shared is not None else local

    async def put(self, key: str, backend: str) -> None:
        await self.local.put(key, backend)
        if self._patient:
            await self._link.write(self._put, lambda: self.shared.put(key, backend))
        else:
            self._link.submit(self._put, lambda: self.shared.put(key, backend))
