"""Session stickiness: an explicit session key keeps its backend while it is used."""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

from prefix_gateway.clock import Clock, monotonic


class SessionStore(Protocol):
    async def get(self, key: str) -> str | None: ...

    async def put(self, key: str, backend: str) -> None:
        """Bind `key` to `backend` and restart its TTL."""
        ...


class InMemorySessionStore:
    def __init__(self, ttl: float, max_sessions: int, clock: Clock = monotonic) -> None:
        self._ttl = ttl
        self._max = max_sessions
        self._clock = clock
        self._sessions: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    async def get(self, key: str) -> str | None:
        entry = self._sessions.get(key)
        if entry is None:
            return None
        backend, touched = entry
        if self._clock() - touched > self._ttl:
            del self._sessions[key]
            return None
        return backend

    async def put(self, key: str, backend: str) -> None:
        now = self._clock()
        self._sessions[key] = (backend, now)
        self._sessions.move_to_end(key)
        while len(self._sessions) > self._max:
            self._sessions.popitem(last=False)
        oldest = now - self._ttl
        while self._sessions:
            _, (_, touched) = next(iter(self._sessions.items()))
            if touched >= oldest:
                break
            self._sessions.popitem(last=False)
