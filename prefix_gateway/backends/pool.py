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

from prefix_gateway.backends.backend import Backend, ModelPool
from prefix_gateway.config import ConfigError
from prefix_gateway.config.backend_specs import read_backend_spec
from prefix_gateway.prompt.hashing import key_hash

log = logging.getLogger("prefix_gateway.backends.pool")


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

    def credentialed(self, url: str) -> bool:
        """Whether `url` is at a backend that gets the upstream key (`Backend.credentialed`)."""
        return any(
            backend.credentialed and (url == backend.url or url.startswith(backend.url + "/"))
            for backend in self.backends
        )

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

    def context_length(self, model: str) -> int | None:
        """The longest context a replica serving `model` reports (an adapter's, its base
        model's); None where none does."""
        serving = self._by_model.get(model)
        if serving is None:
            return None
        found = [
            length
            for backend in serving.backends
            if (length := backend.context_lengths.get(backend.parents.get(model, model)))
        ]
        return max(found, default=None)

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
        self,
        backend: Backend,
        models: frozenset[str],
        parents: Mapping[str, str] | None = None,
        context_lengths: Mapping[str, int] | None = None,
    ) -> None:
        """Its `/v1/models` lists `models`, the adapters among them with their `parents` (a
        backend given as `MODEL=URL` keeps its own), and the context lengths it reports."""
        if context_lengths is not None:
            backend.context_lengths = context_lengths
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
    """One request in flight to `backend`, counted from `take` (or `with`) until `release`,
    which gives it back once however often it is called: a placement takes it, the attempt
    that reaches the backend adopts it, and whichever ends the request releases it. A class,
    not a generator: it is taken on every request."""

    __slots__ = ("backend", "held")

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.held = False

    def take(self) -> Lease:
        self.backend.leased()
        self.held = True
        return self

    def release(self) -> None:
        if self.held:
            self.held = False
            self.backend.released()

    def __enter__(self) -> Backend:
        self.take()
        return self.backend

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def parse_backend_spec(spec: str, source: str = "static") -> Backend:
    """A backend from `URL` or `MODEL=URL` (`read_backend_spec`); `source` says who adds it."""
    read = read_backend_spec(spec)
    models = frozenset({read.model}) if read.model else frozenset()
    return Backend(
        name=read.name, url=read.url, models=models, pinned_model=read.model, source=source
    )
