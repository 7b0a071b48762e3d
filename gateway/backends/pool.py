"""The backend pool: membership, the models each backend serves, health and load.

A backend given as `MODEL=URL` serves that model only; a bare URL serves what its
`/v1/models` lists. Backends are added and removed (at once, or by draining) while serving.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import urlsplit

from gateway.config import ConfigError

log = logging.getLogger("gateway.backends.pool")


class Work(Protocol):
    """An attempt running on a backend, as its health sees it."""

    sent_at: float
    """`time.monotonic()` when it was sent."""
    blocks_ahead: int
    """Prompt blocks the backend had to compute before this one's first byte, its own included."""
    first_byte_at: float
    """`time.perf_counter()` of its first byte; 0 while it waits for one."""

    def stop(self) -> None:
        """End it: before its first byte it moves to another backend, after it fails."""
        ...


@dataclass(eq=False)
class Backend:
    name: str
    url: str
    models: frozenset[str] = frozenset()
    pinned_model: str | None = None
    healthy: bool = False
    source: str = "static"
    """Who added it: `static`, `admin`, or the discovery source that found it."""
    draining: bool = False
    idle: asyncio.Event | None = field(default=None, repr=False)
    """Set when a draining backend's last request in flight ends."""
    ejected: bool = False
    """Taken out by failures (not merely starting): readmitted after enough passed probes."""
    probe_streak: int = 0
    """Consecutive probe results of one kind: > 0 passed, < 0 failed."""
    failures: int = 0
    """Failed requests in a row; a good answer resets it (see gateway.backends.health)."""
    groups: list[ModelPool] = field(default_factory=list, repr=False)
    """The candidate groups it is in now, whose load tallies follow its own."""
    pending_prefill: int = field(default=0, repr=False)
    """Unmatched prompt blocks of this gateway's requests to it that have no first byte yet."""
    fleet_pending_prefill: int = field(default=0, repr=False)
    """The other gateways' pending prefill there, as of the last exchange through Redis."""
    work: set[Work] = field(default_factory=set, repr=False)
    """This gateway's attempts running on it now."""
    progressed_at: float = field(default=0.0, repr=False)
    """`time.monotonic()` when it last produced anything: a byte of a response, or tokens its
    engine counted between two scrapes."""
    stalled: bool = False
    """It answers probes but produced nothing while requests waited on it: out of routing until
    an inference probe passes."""
    ejected_why: str = ""
    _in_flight: int = field(default=0, repr=False)
    _queued: int = field(default=0, repr=False)

    @property
    def load(self) -> int:
        return self._in_flight + self._queued

    @property
    def in_flight(self) -> int:
        """Requests this gateway has sent it that have not ended."""
        return self._in_flight

    @in_flight.setter
    def in_flight(self, value: int) -> None:
        self._add_load(value - self._in_flight)
        self._in_flight = value

    @property
    def queued(self) -> int:
        """Requests waiting in the engine's own queue, where scraped."""
        return self._queued

    @queued.setter
    def queued(self, value: int) -> None:
        self._add_load(value - self._queued)
        self._queued = value

    def _add_load(self, delta: int) -> None:
        for group in self.groups:
            group.total_load += delta


class ModelPool:
    """The backends serving one model now, with their summed load kept up to date by every
    change of a backend's load, so that the load bound costs O(1) instead of a sum."""

    __slots__ = (
        "backends",
        "by_name",
        "loads",
        "members",
        "names",
        "pending_prefill",
        "total_load",
    )

    def __init__(self, backends: list[Backend]) -> None:
        self.backends = backends
        self.names = tuple(backend.name for backend in backends)
        self.members = frozenset(self.names)
        self.by_name = {backend.name: backend for backend in backends}
        self.loads = LoadView(self.by_name)
        self.pending_prefill = PendingPrefillView(self.by_name)
        self.total_load = sum(backend.load for backend in backends)


class _PerBackend(Mapping[str, int]):
    """One number per candidate, read from the backend when asked: a mapping nobody fills.
    Subclasses implement `get` themselves: the policy calls it several times a decision."""

    __slots__ = ("_by_name",)

    def __init__(self, by_name: dict[str, Backend]) -> None:
        self._by_name = by_name

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)


class LoadView(_PerBackend):
    """Each candidate's current load."""

    __slots__ = ()

    def __getitem__(self, name: str) -> int:
        return self._by_name[name].load

    def get(self, name: str, default: int = 0) -> int:  # type: ignore[override]
        backend = self._by_name.get(name)
        return default if backend is None else backend.load


class PendingPrefillView(_PerBackend):
    """Each candidate's pending prefill in blocks: this gateway's and the fleet's."""

    __slots__ = ()

    def __getitem__(self, name: str) -> int:
        backend = self._by_name[name]
        return backend.pending_prefill + backend.fleet_pending_prefill

    def get(self, name: str, default: int = 0) -> int:  # type: ignore[override]
        backend = self._by_name.get(name)
        if backend is None:
            return default
        return backend.pending_prefill + backend.fleet_pending_prefill


@dataclass
class BackendPool:
    backends: list[Backend] = field(default_factory=list)
    _by_model: dict[str, ModelPool] = field(default_factory=dict)
    removed: list[Callable[[str], object]] = field(default_factory=list)
    """Told the name of each backend taken out of the pool (to forget what is kept of it)."""

    @classmethod
    def from_specs(cls, specs: Sequence[str]) -> BackendPool:
        pool = cls()
        for spec in specs:
            pool.add(parse_backend_spec(spec))
        return pool

    def add(self, backend: Backend) -> None:
        if any(existing.name == backend.name for existing in self.backends):
            raise ConfigError(f"backend {backend.name} given twice")
        self.backends.append(backend)
        self.backends.sort(key=lambda item: item.name)
        self.rebuild()

    def get(self, name: str) -> Backend | None:
        return next((backend for backend in self.backends if backend.name == name), None)

    def remove(self, name: str) -> Backend | None:
        """Take a backend out at once; requests already sent to it run to their end."""
        backend = self.get(name)
        if backend is not None:
            self.backends.remove(backend)
            self.rebuild()
            log.warning("backend %s removed", name)
            for listener in self.removed:
                listener(name)
        return backend

    def start_drain(self, name: str) -> Backend | None:
        """Stop sending `name` new requests; `finish_drain` waits for the rest and removes it."""
        backend = self.get(name)
        if backend is not None and not backend.draining:
            backend.draining = True
            backend.idle = asyncio.Event()
            self.rebuild()
            log.warning("backend %s draining (%d in flight)", name, backend.in_flight)
        return backend

    async def finish_drain(self, backend: Backend, timeout: float) -> bool:
        """Wait (at most `timeout` s) for a draining backend's requests, then remove it; False
        when it was restored or replaced meanwhile."""
        idle = backend.idle
        if backend.in_flight > 0 and idle is not None:
            with suppress(TimeoutError):
                await asyncio.wait_for(idle.wait(), timeout)
        if not backend.draining or self.get(backend.name) is not backend:
            return False
        self.remove(backend.name)
        return True

    def undrain(self, backend: Backend) -> None:
        """Route to a draining backend again (it came back before its drain ended)."""
        if backend.draining:
            backend.draining = False
            self.rebuild()
            if backend.idle is not None:
                backend.idle.set()
                backend.idle = None

    def rebuild(self) -> None:
        """Recompute the per-model candidate lists after a health or membership change."""
        serving: dict[str, list[Backend]] = {}
        for backend in self.backends:
            backend.groups = []
            if backend.healthy and not backend.draining:
                for model in backend.models:
                    serving.setdefault(model, []).append(backend)
        by_model = {model: ModelPool(backends) for model, backends in serving.items()}
        for group in by_model.values():
            for backend in group.backends:
                backend.groups.append(group)
        self._by_model = by_model

    def serving(self, model: str) -> ModelPool | None:
        """The candidates of `model` with their load tally; None when no backend serves it."""
        return self._by_model.get(model)

    def knows_model(self, model: str) -> bool:
        return any(model in backend.models for backend in self.backends)

    def served_models(self) -> list[str]:
        return sorted(self._by_model)

    def set_health(self, backend: Backend, healthy: bool) -> bool:
        """Record a health observation; True when it changed the backend's state."""
        if backend.healthy == healthy:
            return False
        backend.healthy = healthy
        log.log(
            logging.INFO if healthy else logging.WARNING,
            "backend %s is now %s",
            backend.name,
            "healthy" if healthy else "unhealthy",
        )
        self.rebuild()
        return True

    def lease(self, backend: Backend) -> Lease:
        """Count a request in flight to `backend` for exactly as long as it runs."""
        return Lease(backend)


class Lease:
    """`with pool.lease(backend):` — a class, not a generator: it is entered on every request."""

    __slots__ = ("backend",)

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def __enter__(self) -> Backend:
        backend = self.backend
        backend.in_flight += 1
        return backend

    def __exit__(self, *exc_info: object) -> None:
        backend = self.backend
        backend.in_flight -= 1
        if backend.idle is not None and backend.in_flight == 0:
            backend.idle.set()


def parse_backend_spec(spec: str) -> Backend:
    """A backend from `URL` or `MODEL=URL`: http(s), a host, no credentials in the URL."""
    if any(char.isspace() or not char.isprintable() for char in spec.strip()):
        raise ConfigError(f"backend {spec!r} holds whitespace or control characters")
    model: str | None = None
    url = spec.strip()
    if "=" in url and not url.split("=", 1)[0].startswith(("http://", "https://")):
        model, url = (part.strip() for part in url.split("=", 1))
    if "://" not in url:
        url = "http://" + url
    try:
        parts = urlsplit(url)
        hostname = parts.hostname
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError as exc:  # e.g. an unbalanced IPv6 bracket, a port out of range
        raise ConfigError(f"backend {spec!r} is not an http(s) URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not hostname:
        raise ConfigError(f"backend {spec!r} is not an http(s) URL")
    if "@" in parts.netloc:
        raise ConfigError(f"backend {spec!r} carries credentials: use --upstream-api-key")
    if parts.query or parts.fragment:
        raise ConfigError(f"backend {spec!r} has a query or fragment")
    base = url.rstrip("/")
    if base.endswith("/v1"):
        base = base[: -len("/v1")]
    name = parts.netloc
    models = frozenset({model}) if model else frozenset()
    return Backend(name=name, url=base, models=models, pinned_model=model)
