"""LoRA adapters loaded on demand: those of `lora_adapters` that no replica serves yet are
loaded, through vLLM's `POST /v1/load_lora_adapter`, on the replica the routing policy picks
for them, once however many requests wait for it (one load of an adapter at a time); they are
unloaded (`POST /v1/unload_lora_adapter`) from a replica that has not been sent a request for
them in `lora_idle_unload` seconds. Engines must run with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`
(docs/adapters.md).

A replica that failed to load an adapter is not asked again for it until its backoff has passed
(5 s, doubling with each failure there up to 5 minutes); while every replica that could host
it is backing off, a request for it is answered at once from that remembered failure: 503
`adapter unavailable` with `Retry-After`. What a replica said goes to the log, never to the
client (it names paths on the replica's disk).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from prefix_gateway.backends.backend import Backend, ModelPool
from prefix_gateway.backends.pool import BackendPool
from prefix_gateway.clock import Clock, monotonic
from prefix_gateway.config.adapters import AdapterSpec
from prefix_gateway.errors import GatewayError
from prefix_gateway.metrics import Metrics
from prefix_gateway.prompt.hashing import key_hash
from prefix_gateway.refusals import refused

log = logging.getLogger("prefix_gateway.backends.adapters")

_LOAD_SECONDS = 120.0
"""How long a load may take: the replica reads the adapter's weights (health probes' timeout
is for answers that read nothing)."""
_ALREADY_LOADED = "has already been loaded"
"""vLLM's 400 for a load of an adapter it holds (loaded meanwhile by another gateway)."""
FIRST_BACKOFF = 5.0
"""Seconds an adapter is not tried again on a replica after its first failed load there;
doubled after each further failure."""
_LONGEST_BACKOFF = 300.0


@dataclass(slots=True)
class _Failure:
    """An adapter's last failed load on one replica: not tried there again before `until`."""

    until: float
    pause: float


class AdapterLoader:
    def __init__(
        self,
        pool: BackendPool,
        client: httpx.AsyncClient,
        specs: Sequence[AdapterSpec],
        idle_unload: float,
        metrics: Metrics,
        clock: Clock = monotonic,
    ) -> None:
        self._pool = pool
        self._client = client
        self._specs = {spec.name: spec for spec in specs}
        self._idle_unload = idle_unload
        self._metrics = metrics
        self._clock = clock
        self._loading: dict[str, asyncio.Task[None]] = {}
        self._last_sent: dict[tuple[str, str], float] = {}
        """(backend, adapter) to when a request for the adapter was last sent there."""
        self._failed: dict[tuple[str, str], _Failure] = {}
        """(backend, adapter) to its last failed load there, while it is remembered."""
        self._task: asyncio.Task[None] | None = None
        pool.removed.append(self._forget)

    def declared(self) -> list[str]:
        return sorted(self._specs)

    def unserved(self) -> dict[str, str | None]:
        """The declared adapters no healthy replica serves now, each with its base model (as
        declared, else the fleet's one base model; None when there are several)."""
        pool = self._pool
        bases = {
            model for backend in pool.backends for model in backend.models - backend.parents.keys()
        }
        only = next(iter(bases)) if len(bases) == 1 else None
        return {
            name: spec.base_model or only
            for name, spec in self._specs.items()
            if pool.serving(name) is None
        }

    async def place(self, model: str, pick: Callable[[ModelPool], Backend]) -> None:
        """Load `model` where `pick` chooses, if it is a declared adapter no healthy replica
        serves; concurrent callers wait for the one load (and share its error)."""
        spec = self._specs.get(model)
        if spec is None or self._pool.serving(model) is not None:
            return
        loading = self._loading.get(model)
        if loading is None:
            loading = asyncio.create_task(self._load(spec, pick), name=f"load-adapter-{model}")
            self._loading[model] = loading
            loading.add_done_callback(lambda _: self._loading.pop(model, None))
            loading.add_done_callback(_retrieve)
        await asyncio.shield(loading)

    def sent(self, model: str, backend: str) -> None:
        """A request for `model` was routed to `backend`: a declared adapter stays loaded."""
        if model in self._specs:
            self._last_sent[(backend, model)] = self._clock()

    async def _load(self, spec: AdapterSpec, pick: Callable[[ModelPool], Backend]) -> None:
        """Load on the replica `pick` chooses; where that fails, on its next choice among the
        others not backing off from a failure of their own, until one loads it or none is
        left."""
        now = self._clock()
        hosts = [
            backend
            for backend in self._pool.backends
            if backend.healthy and not backend.draining and _may_host(backend, spec)
        ]
        if not hosts:
            raise refused("no_healthy_backend", spec.name)
        ready = [backend for backend in hosts if not self._backing_off(backend, spec, now)]
        while ready:
            backend = pick(ModelPool(ready, key_hash(spec.name)))
            why = await self._loads_on(backend, spec)
            loaded = not why
            self._metrics.child(
                self._metrics.adapters.loads, spec.name, "loaded" if loaded else "failed"
            ).inc()
            if loaded:
                log.info("LoRA adapter %s loaded on %s", spec.name, backend.name)
                self._failed.pop((backend.name, spec.name), None)
                self._last_sent[(backend.name, spec.name)] = self._clock()
                self._pool.adapter_loaded(backend, spec.name, spec.base_model or _base_of(backend))
                return
            failure = self._remember_failure(backend, spec)
            log.warning(
                "LoRA adapter %s not loaded on %s (not tried there again for %g s): %s",
                spec.name,
                backend.name,
                failure.pause,
                why,
            )
            ready.remove(backend)
        raise self._unavailable(spec, hosts)

    def _backing_off(self, backend: Backend, spec: AdapterSpec, now: float) -> bool:
        failure = self._failed.get((backend.name, spec.name))
        return failure is not None and failure.until > now

    def _remember_failure(self, backend: Backend, spec: AdapterSpec) -> _Failure:
        key = (backend.name, spec.name)
        earlier = self._failed.get(key)
        pause = FIRST_BACKOFF if earlier is None else min(earlier.pause * 2, _LONGEST_BACKOFF)
        failure = self._failed[key] = _Failure(self._clock() + pause, pause)
        return failure

    def _unavailable(self, spec: AdapterSpec, hosts: list[Backend]) -> GatewayError:
        """The refusal of a request for `spec` while every one of `hosts` backs off."""
        now = self._clock()
        next_try = min(self._failed[(backend.name, spec.name)].until for backend in hosts)
        seconds = max(1, math.ceil(next_try - now))
        return refused(
            "adapter_unavailable", spec.name, headers=((b"retry-after", str(seconds).encode()),)
        )

    async def _loads_on(self, backend: Backend, spec: AdapterSpec) -> str:
        """Why `backend` did not load the adapter; empty when it did."""
        body = {"lora_name": spec.name, "lora_path": spec.path}
        try:
            response = await self._client.post(
                backend.url + "/v1/load_lora_adapter", json=body, timeout=_LOAD_SECONDS
            )
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
        if response.status_code == 200 or (
            response.status_code == 400 and _ALREADY_LOADED in response.text
        ):
            return ""
        return f"HTTP {response.status_code}: {response.text[:200]}"

    async def unload_idle(self) -> None:
        """Unload each declared adapter from the replicas not sent a request for it within
        the idle time (counted, for one found there, from when it was found)."""
        now = self._clock()
        for backend in list(self._pool.backends):
            for name in self._specs.keys() & backend.parents.keys():
                last = self._last_sent.setdefault((backend.name, name), now)
                if now - last >= self._idle_unload and name not in self._loading:
                    await self._unload(backend, name)

    async def _unload(self, backend: Backend, name: str) -> None:
        body = {"lora_name": name}
        try:
            response = await self._client.post(backend.url + "/v1/unload_lora_adapter", json=body)
            # A 404: it was gone already (the replica restarted, or another gateway unloaded it).
            unloaded = response.status_code in (200, 404)
        except httpx.HTTPError:
            unloaded = False
        outcome = "unloaded" if unloaded else "failed"
        self._metrics.child(self._metrics.adapters.unloads, name, outcome).inc()
        if unloaded:
            log.info("LoRA adapter %s unloaded from %s: idle", name, backend.name)
            self._last_sent.pop((backend.name, name), None)
            self._pool.adapter_unloaded(backend, name)

    def start(self) -> None:
        if self._specs and self._idle_unload > 0:
            self._task = asyncio.create_task(self._run(), name="adapter-unloads")

    async def stop(self) -> None:
        tasks = [task for task in [self._task, *self._loading.values()] if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self) -> None:
        interval = min(max(self._idle_unload / 4, 0.1), 30.0)
        while True:
            await asyncio.sleep(interval)
            await self.unload_idle()

    def _forget(self, backend: str) -> None:
        for key in [key for key in self._last_sent if key[0] == backend]:
            del self._last_sent[key]
        for key in [key for key in self._failed if key[0] == backend]:
            del self._failed[key]


def _retrieve(task: asyncio.Task[None]) -> None:
    """Take a load's error off its task: the requests that waited for it answered it."""
    if not task.cancelled():
        task.exception()


def _may_host(backend: Backend, spec: AdapterSpec) -> bool:
    if spec.base_model:
        return spec.base_model in backend.models and spec.base_model not in backend.parents
    return bool(backend.models - backend.parents.keys())


def _base_of(backend: Backend) -> str:
    return min(backend.models - backend.parents.keys())
