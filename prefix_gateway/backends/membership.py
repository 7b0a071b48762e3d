"""One discovery source's share of the pool: replicas that appear are added and probed, those
that go are drained and removed; other sources' backends are never touched.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from prefix_gateway.backends.backend import Backend
from prefix_gateway.backends.pool import BackendPool, parse_backend_spec
from prefix_gateway.config import ConfigError

log = logging.getLogger("prefix_gateway.backends.discovery")

ProbeBackend = Callable[[Backend], Coroutine[Any, Any, None]]


@dataclass(frozen=True)
class ServiceSpec:
    """What one discovery flag names: a host or Service, a port, and optionally a model."""

    host: str
    port: str
    model: str | None = None

    @classmethod
    def parse(cls, spec: str, port_required: bool) -> ServiceSpec:
        model: str | None = None
        rest = spec.strip()
        if "=" in rest:
            model, rest = (part.strip() for part in rest.split("=", 1))
        host, separator, port = rest.removeprefix("http://").rpartition(":")
        if not separator:
            host, port = port, ""
        if not host or (port_required and not port.isdigit()):
            form = "[MODEL=]HOST:PORT" if port_required else "[MODEL=]NAME[:PORT]"
            raise ConfigError(f"{spec!r} is not {form}")
        return cls(host, port, model or None)


def address_url(address: str, port: int | str) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{port}"


class Membership:
    """One source's replicas in the pool: adds those that appear, drains those that go."""

    def __init__(
        self,
        pool: BackendPool,
        source: str,
        model: str | None,
        probe: ProbeBackend,
        drain_timeout: float,
    ) -> None:
        self._pool = pool
        self.source = source
        self._model = model
        self._probe = probe
        self._drain_timeout = drain_timeout
        self._tasks: set[asyncio.Task[Any]] = set()
        self._probes: set[asyncio.Task[Any]] = set()

    def update(self, urls: Iterable[str]) -> None:
        wanted: dict[str, Backend] = {}
        for url in urls:
            spec = f"{self._model}={url}" if self._model else url
            backend = parse_backend_spec(spec, self.source)
            wanted[backend.name] = backend
        for name, backend in wanted.items():
            existing = self._pool.get(name)
            if existing is None:
                self._pool.add(backend)
                log.warning("backend %s joined (%s)", name, self.source)
                self._probes.add(self._spawn(self._probe(backend)))
            elif existing.source != self.source:
                log.debug("%s: %s is already a backend from %s", self.source, name, existing.source)
            elif existing.draining:
                log.warning("backend %s is back (%s)", name, self.source)
                self._pool.undrain(existing)
        for backend in list(self._pool.backends):
            gone = backend.name not in wanted and not backend.draining
            if gone and backend.source == self.source:
                log.warning("backend %s left (%s)", backend.name, self.source)
                self._pool.start_drain(backend.name)
                self._spawn(self._pool.finish_drain(backend, self._drain_timeout))

    def _spawn(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(self._probes.discard)
        return task

    async def probed(self) -> None:
        """Wait for the first probe of every backend added so far."""
        await asyncio.gather(*self._probes, return_exceptions=True)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class Source(Protocol):
    membership: Membership

    async def sync(self) -> None:
        """Look once and update the membership; raise when the source cannot be read."""
        ...

    async def run(self) -> None:
        """Follow the source until cancelled."""
        ...

    async def close(self) -> None: ...
