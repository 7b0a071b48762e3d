"""Active health probes and model lists: every backend asked on an interval."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import suppress

import httpx

from prefix_gateway.backends.pool import Backend, BackendPool


class BackendMonitor:
    """Probes health and refreshes model lists in the background."""

    def __init__(
        self,
        pool: BackendPool,
        client: httpx.AsyncClient,
        health_interval: float,
        models_interval: float,
        on_probe: Callable[[Backend, bool], object] | None = None,
        on_inference_probe: Callable[[Backend, bool], object] | None = None,
    ) -> None:
        self._pool = pool
        self._client = client
        # Where each probe's verdict goes (prefix_gateway.backends.health applies the thresholds).
        self._on_probe = on_probe or pool.set_health
        self._on_inference_probe = on_inference_probe
        self._health_interval = health_interval
        self._models_interval = models_interval
        self._task: asyncio.Task[None] | None = None

    async def refresh_all(self) -> None:
        await asyncio.gather(*(self.refresh(backend) for backend in self._pool.backends))

    async def refresh(self, backend: Backend, with_models: bool = True) -> None:
        """Probe one backend now: health, and its model list unless pinned to a model; a
        stalled one with a one-token completion instead."""
        if backend.stalled and self._on_inference_probe is not None:
            self._on_inference_probe(backend, await self._infers(backend))
            return
        try:
            response = await self._client.get(backend.url + "/health")
            healthy = response.status_code == 200
            if healthy and with_models and backend.pinned_model is None:
                listing = await self._client.get(backend.url + "/v1/models")
                listing.raise_for_status()
                cards = [item for item in listing.json().get("data", []) if "id" in item]
                models = frozenset(str(item["id"]) for item in cards)
                parents = {
                    str(item["id"]): str(item["parent"]) for item in cards if item.get("parent")
                }
                self._pool.models_listed(backend, models, parents)
        except (httpx.HTTPError, httpx.InvalidURL, ValueError, KeyError, TypeError):
            healthy = False
        self._on_probe(backend, healthy)

    async def _infers(self, backend: Backend) -> bool:
        """Whether the backend completes one token of a tiny prompt in time."""
        model = backend.pinned_model or min(backend.models, default=None)
        if model is None:
            return False
        body = {"model": model, "prompt": "ping", "max_tokens": 1, "temperature": 0}
        try:
            response = await self._client.post(backend.url + "/v1/completions", json=body)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="backend-monitor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_models = loop.time() + self._models_interval
        while True:
            await asyncio.sleep(self._health_interval)
            with_models = loop.time() >= next_models
            if with_models:
                next_models = loop.time() + self._models_interval
            await asyncio.gather(
                *(self.refresh(backend, with_models) for backend in self._pool.backends)
            )
