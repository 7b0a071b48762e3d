"""Active health probes and model lists: every backend asked on an interval."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import suppress

import httpx

from prefix_gateway.backends.backend import Backend
from prefix_gateway.backends.pool import BackendPool

log = logging.getLogger("prefix_gateway.backends.monitor")


def _reason(error: Exception) -> str:
    """What went wrong, in words an operator can act on: the exception's own message, which
    httpx leaves empty on some timeouts, after its class."""
    if isinstance(error, httpx.HTTPStatusError):
        return f"answered {error.response.status_code}"
    text = str(error).strip()
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


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
        path = "/health"
        try:
            response = await self._client.get(backend.url + path)
            error = "" if response.status_code == 200 else f"answered {response.status_code}"
            if not error and with_models and backend.pinned_model is None:
                path = "/v1/models"
                listing = await self._client.get(backend.url + path)
                listing.raise_for_status()
                cards = [item for item in listing.json().get("data", []) if "id" in item]
                models = frozenset(str(item["id"]) for item in cards)
                parents = {
                    str(item["id"]): str(item["parent"]) for item in cards if item.get("parent")
                }
                lengths = {
                    str(item["id"]): item["max_model_len"]
                    for item in cards
                    if isinstance(item.get("max_model_len"), int) and item["max_model_len"] > 0
                }
                self._pool.models_listed(backend, models, parents, lengths)
        except (httpx.HTTPError, httpx.InvalidURL, ValueError, KeyError, TypeError) as exc:
            error = _reason(exc)
        if error:
            error = f"GET {path}: {error}"
        if backend.probe_answered(error):
            log.warning("backend %s failed its health probe: %s", backend.name, error)
        self._on_probe(backend, not error)

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
