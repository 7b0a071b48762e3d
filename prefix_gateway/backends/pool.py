"""The backend pool: membership, the models each backend serves, health and load.

A backend given as `MODEL=URL` serves that model only; a bare URL serves what its
`/v1/models` lists. Backends are added and removed (at once, or by draining) while serving.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Protocol

from prefix_gateway.backends.load_views import LoadView, PendingPrefillView
from prefix_gateway.config import ConfigError
from prefix_gateway.config.backend_specs import read_backend_spec
from prefix_gateway.prompt.hashing import key_hash

log = logging.getLogger("prefix_gateway.backends.pool")


class Work(Protocol):
    """An attempt running on a backend, as its health sees it."""

    sent_at: float
    """`time.monotonic()` when it was sent."""
    blocks_ahead: int
    """Prompt blocks the backend had to compute before this one's first byte, its own included."""
    first_byte_at: float
    """`time.perf_counter()` of its first byte; 0 while it waits for one."""
    judged_from: float
    """`time.monotonic()` from which the backend's silence counts against it for this work:
    when it was sent, or when it last stopped waiting on its client."""

    @property
    def awaiting_client(self) -> bool:
        """It waits for its client to read: no evidence against the backend meanwhile."""
        ...

    def stop(self) -> None:
        """End it: before its first byte it moves to another backend, after it fails."""
        ...


@dataclass(eq=False)
class Backend:
    """One replica as this gateway knows it. Only this module writes its fields: the other
    modules report what happened through the methods below, named after the event, so that
    each rule (the load tallies, what an ejection clears) is kept in one place."""

    name: str
    url: str
    models: frozenset[str] = frozenset()
    pinned_model: str | None = None
    parents: Mapping[str, str] = field(default_factory=dict)
    """The LoRA adapters among `models`, each with the base model its `/v1/models` names as
    `parent`."""
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
    """Failed requests in a row; a good answer resets it (see prefix_gateway.backends.health)."""
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
    last_probe_error: str = ""
    """Why its last failed health probe failed; kept once it passes again."""
    probe_failing: bool = False
    """Its last health probe failed."""
    _in_flight: int = field(default=0, repr=False)
    _queued: int = field(default=0, repr=False)

    @property
    def load(self) -> int:
        return self._in_flight + self._queued

    @property
    def in_flight(self) -> int:
        """Requests this gateway has sent it that have not ended."""
        return self._in_flight

    @property
    def queued(self) -> int:
        """Requests waiting in the engine's own queue, where scraped."""
        return self._queued

    def leased(self) -> None:
        """An attempt took a lease here: one more request in flight."""
        self._in_flight += 1
        for group in self.groups:
            group.total_load += 1

    def released(self) -> None:
        """An attempt's lease ended; the last one of a draining backend sets `idle`."""
        self._in_flight -= 1
        for group in self.groups:
            group.total_load -= 1
        if self.idle is not None and self._in_flight == 0:
            self.idle.set()

    def load_sampled(self, queued: int) -> None:
        """The requests there that this gateway did not send, as the engine's last scrape and
        the other gateways' counts put them."""
        delta = queued - self._queued
        if delta:
            self._queued = queued
            for group in self.groups:
                group.total_load += delta

    def prefill_queued(self, blocks: int) -> None:
        """An attempt here waits for `blocks` of its prompt to be computed."""
        self.pending_prefill += blocks

    def prefill_ended(self, blocks: int) -> None:
        """An attempt's `blocks` are computed (its first byte came) or will not be."""
        self.pending_prefill -= blocks

    def fleet_prefill_reported(self, blocks: int) -> None:
        """The other gateways' pending prefill here, just read from Redis."""
        self.fleet_pending_prefill = blocks

    def attempt_sent(self, work: Work) -> None:
        self.work.add(work)

    def attempt_ended(self, work: Work) -> None:
        self.work.discard(work)

    def progressed(self, at: float) -> None:
        """It produced a byte at `at`. Called once per streamed chunk: a store, nothing more."""
        self.progressed_at = at

    def generated_since(self, at: float) -> None:
        """Its engine counted new tokens at some time after `at` (its previous scrape)."""
        if at > self.progressed_at:
            self.progressed_at = at

    def probe_passed(self) -> int:
        """One more passed probe; the passes in a row."""
        self.probe_streak = max(self.probe_streak, 0) + 1
        return self.probe_streak

    def probe_failed(self) -> int:
        """One more failed probe; the failures in a row."""
        self.probe_streak = min(self.probe_streak, 0) - 1
        return -self.probe_streak

    def probe_answered(self, error: str) -> bool:
        """A health probe ended, failed for `error` or passed (""); True when it failed and
        the one before had not: the first of a run of failures."""
        first = bool(error) and not self.probe_failing
        self.probe_failing = bool(error)
        if error:
            self.last_probe_error = error
        return first

    def request_succeeded(self) -> None:
        if self.failures:
            self.failures = 0

    def request_failed(self) -> int:
        """One more failed request; the failures in a row."""
        self.failures += 1
        return self.failures

    def stall(self) -> None:
        """It produced nothing while requests waited: only an inference probe clears this."""
        self.stalled = True

    def eject(self, why: str) -> None:
        """Taken out by failures: its probes count anew towards readmission."""
        self.ejected = True
        self.ejected_why = why
        self.probe_streak = 0

    def readmit(self) -> None:
        """Back in routing with a clean record, having passed one probe at least."""
        self.ejected = False
        self.ejected_why = ""
        self.stalled = False
        self.failures = 0
        self.probe_streak = max(self.probe_streak, 1)


class ModelPool:
    """The backends serving one model now, with their summed load kept up to date by every
    change of a backend's load, so that the load bound costs O(1) instead of a sum."""

    __slots__ = (
        "adapter_key",
        "backends",
        "by_name",
        "loads",
        "members",
        "names",
        "pending_prefill",
        "total_load",
    )

    def __init__(self, backends: list[Backend], adapter_key: int | None = None) -> None:
        self.backends = backends
        self.adapter_key = adapter_key
        """The ring key of a LoRA adapter's group: its requests gather on few replicas."""
        self.names = tuple(backend.name for backend in backends)
        self.members = frozenset(self.names)
        self.by_name = {backend.name: backend for backend in backends}
        self.loads = LoadView(self.by_name)
        self.pending_prefill = PendingPrefillView(self.by_name)
        self.total_load = sum(backend.load for backend in backends)

    def having(self, room: Callable[[Backend], bool]) -> ModelPool:
        """The backends `room` admits, as a group of their own (this one when it admits all);
        a group made here is not kept up to date: it serves one decision."""
        chosen = [backend for backend in self.backends if room(backend)]
        if len(chosen) == len(self.backends):
            return self
        return ModelPool(chosen, self.adapter_key)


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
        adapters = self.adapters()
        by_model = {
            model: ModelPool(backends, key_hash(model) if model in adapters else None)
            for model, backends in serving.items()
        }
        for group in by_model.values():
            for backend in group.backends:
                backend.groups.append(group)
        self._by_model = by_model

    def serving(self, model: str) -> ModelPool | None:
        """The candidates of `model` with their load tally; None when no backend serves it."""
        return self._by_model.get(model)

    def knows_model(self, model: str) -> bool:
        return any(model in backend.models for backend in self.backends)

    def might_serve(self, model: str) -> bool:
        """Whether `model` may be served here once a replica is reachable: a backend lists it,
        one never reached has not listed its models yet, or none is healthy to ask."""
        return (
            self.knows_model(model)
            or not any(backend.healthy for backend in self.backends)
            or any(not backend.models and not backend.healthy for backend in self.backends)
        )

    def served_models(self) -> list[str]:
        return sorted(self._by_model)

    def adapters(self) -> dict[str, str]:
        """Every LoRA adapter a backend lists, with its base model."""
        return {
            name: parent for backend in self.backends for name, parent in backend.parents.items()
        }

    def models_listed(
        self, backend: Backend, models: frozenset[str], parents: Mapping[str, str] | None = None
    ) -> None:
        """Its `/v1/models` lists `models`, the adapters among them with their `parents` (a
        backend given as `MODEL=URL` keeps its own)."""
        parents = parents or {}
        if models != backend.models or parents != backend.parents:
            backend.models = models
            backend.parents = parents
            self.rebuild()

    def adapter_loaded(self, backend: Backend, name: str, parent: str) -> None:
        """It serves adapter `name` from now on, loaded at runtime."""
        self.models_listed(backend, backend.models | {name}, {**backend.parents, name: parent})

    def adapter_unloaded(self, backend: Backend, name: str) -> None:
        """It no longer serves adapter `name`."""
        parents = {adapter: base for adapter, base in backend.parents.items() if adapter != name}
        self.models_listed(backend, backend.models - {name}, parents)

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
        backend.leased()
        return backend

    def __exit__(self, *exc_info: object) -> None:
        self.backend.released()


def parse_backend_spec(spec: str, source: str = "static") -> Backend:
    """A backend from `URL` or `MODEL=URL` (`read_backend_spec`); `source` says who adds it."""
    read = read_backend_spec(spec)
    models = frozenset({read.model}) if read.model else frozenset()
    return Backend(
        name=read.name, url=read.url, models=models, pinned_model=read.model, source=source
    )
