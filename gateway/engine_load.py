"""Engine load signals: each replica's own queue, scraped from its Prometheus endpoint.

A gateway knows only the requests it sent itself. When several gateways share a fleet, each
replica's running and waiting counts (vLLM `vllm:num_requests_running` / `_waiting`, SGLang
`sglang:num_running_reqs` / `num_queue_reqs`) tell every gateway the load the others put there.
The part of the engine's count that this gateway did not send becomes the backend's `queued`
load, which the load bound adds to the gateway's own in-flight count.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import httpx

from gateway.backends import Backend, BackendPool

log = logging.getLogger("gateway.engine_load")

_RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
_WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")


@dataclass(frozen=True)
class EngineLoad:
    running: float = 0.0
    waiting: float = 0.0
    kv_cache_usage: float | None = None

    @property
    def requests(self) -> int:
        return round(self.running + self.waiting)


def parse_engine_load(text: str) -> EngineLoad | None:
    """Sum the engine's series over their label sets; None when it exports none of them."""
    running = waiting = 0.0
    usage: float | None = None
    found = False
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name_end = min((line.find(mark) for mark in ("{", " ") if mark in line), default=-1)
        if name_end <= 0:
            continue
        name = line[:name_end]
        if name not in _RUNNING and name not in _WAITING and name not in _KV_USAGE:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        found = True
        if name in _RUNNING:
            running += value
        elif name in _WAITING:
            waiting += value
        else:
            usage = value if usage is None else max(usage, value)
    return EngineLoad(running, waiting, usage) if found else None


def others_load(engine: EngineLoad, own_in_flight: int) -> int:
    """Requests at the engine that this gateway did not send (never negative)."""
    return max(0, engine.requests - own_in_flight)


class EngineLoadScraper:
    def __init__(self, pool: BackendPool, client: httpx.AsyncClient, interval: float) -> None:
        self._pool = pool
        self._client = client
        self._interval = interval
        self._task: asyncio.Task[None] | None = None
        self.kv_cache_usage: dict[str, float] = {}

    def start(self) -> None:
        if self._interval > 0:
            self._task = asyncio.create_task(self._run(), name="engine-load-scraper")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def scrape_all(self) -> None:
        await asyncio.gather(
            *(self._scrape(backend) for backend in self._pool.backends if backend.healthy)
        )

    async def _scrape(self, backend: Backend) -> None:
        # Our own count at the moment the engine's is read, so the difference is the others'.
        own = backend.in_flight
        try:
            response = await self._client.get(backend.url + "/metrics")
            engine = parse_engine_load(response.text) if response.status_code == 200 else None
        except httpx.HTTPError:
            engine = None
        if engine is None:
            backend.queued = 0
            return
        backend.queued = others_load(engine, own)
        if engine.kv_cache_usage is not None:
            self.kv_cache_usage[backend.name] = engine.kv_cache_usage

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.scrape_all()
            except Exception:  # a scrape must never stop the loop
                log.exception("engine load scrape failed")
