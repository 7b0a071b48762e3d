"""Engine load: each replica's running and waiting requests, scraped from its `/metrics`. The
load this gateway did not send (other gateways', and clients' that bypass them) is `queued`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from prefix_gateway.backends.backend import Backend
from prefix_gateway.backends.pool import BackendPool

log = logging.getLogger("prefix_gateway.backends.engine_load")

_RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
_WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
_GENERATED = ("vllm:generation_tokens_total", "sglang:generation_tokens_total")
_NAMES = (*_RUNNING, *_WAITING, *_KV_USAGE, *_GENERATED)


@dataclass(frozen=True)
class EngineLoad:
    running: float = 0.0
    waiting: float = 0.0
    kv_cache_usage: float | None = None
    generated: float | None = None
    """Tokens the engine has generated since it started (its counter)."""

    @property
    def requests(self) -> int:
        return round(self.running + self.waiting)


def parse_engine_load(text: str) -> EngineLoad | None:
    """Sum the engine's series over their label sets; None when it exports none of them.
    Only the wanted lines are parsed: an engine's page runs to thousands of lines."""
    wanted = "\n".join(line for line in text.splitlines() if line.startswith(_NAMES))
    running = waiting = 0.0
    usage: float | None = None
    generated: float | None = None
    found = False
    try:
        for family in text_string_to_metric_families(wanted):
            for sample in family.samples:
                name, value = sample.name, sample.value
                if name in _RUNNING:
                    running += value
                elif name in _WAITING:
                    waiting += value
                elif name in _KV_USAGE:
                    usage = value if usage is None else max(usage, value)
                elif name in _GENERATED:
                    generated = value + (generated or 0.0)
                else:
                    continue
                found = True
    except ValueError:  # not the exposition format
        return None
    return EngineLoad(running, waiting, usage, generated) if found else None


def missing_engine_series(text: str) -> list[str]:
    """The series this gateway reads from an engine's `/metrics` that `text` lacks, each named
    by its vLLM name (any one of a family's names, vLLM's or SGLang's, counts)."""
    present = {line.split("{", 1)[0].split(" ", 1)[0] for line in text.splitlines()}
    present |= {name.removesuffix("_total") for name in present}
    return [
        family[0]
        for family in (_RUNNING, _WAITING, _KV_USAGE, _GENERATED)
        if not present.intersection(name.removesuffix("_total") for name in family)
    ]


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
        # Per backend: the other gateways' requests in flight (from Redis), their count when
        # the engine was last scraped, and the engine's requests beyond ours at that scrape.
        self._fleet: dict[str, int] = {}
        self._fleet_at_scrape: dict[str, int] = {}
        self._engine_others: dict[str, int] = {}
        self._last_others: dict[str, int] = {}
        self._generated: dict[str, float] = {}
        self._scraped_at: dict[str, float] = {}

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
        # Our own count (and the other gateways') at the moment the engine's is read, so the
        # difference is the others' (and what came from outside the fleet).
        own, fleet = backend.in_flight, self._fleet.get(backend.name, 0)
        asked_at = time.monotonic()
        try:
            response = await self._client.get(backend.url + "/metrics")
            engine = parse_engine_load(response.text) if response.status_code == 200 else None
        except httpx.HTTPError:
            engine = None
        name = backend.name
        self._fleet_at_scrape[name] = fleet
        if engine is None:
            self._engine_others.pop(name, None)
        else:
            # The lower of this scrape's count and the last one's: a request of ours that ended
            # just as the engine was read still counts there, once; load from elsewhere stays.
            others = others_load(engine, own)
            self._engine_others[name] = min(others, self._last_others.get(name, 0))
            self._last_others[name] = others
            if engine.kv_cache_usage is not None:
                self.kv_cache_usage[name] = engine.kv_cache_usage
            if engine.generated is not None:
                if engine.generated > self._generated.get(name, engine.generated):
                    # Tokens came, for anyone's requests, at some time since the last scrape.
                    since = self._scraped_at.get(name, 0.0)
                    backend.generated_since(since)
                self._generated[name] = engine.generated
        self._scraped_at[name] = asked_at
        self._apply(backend)

    def forget(self, name: str) -> None:
        """`name` left the pool: nothing of it is kept."""
        for kept in (
            self.kv_cache_usage,
            self._fleet_at_scrape,
            self._engine_others,
            self._last_others,
            self._generated,
            self._scraped_at,
        ):
            kept.pop(name, None)

    def set_fleet(self, others: dict[str, int]) -> None:
        """The other gateways' requests in flight per backend, just read from Redis."""
        self._fleet = others
        for backend in self._pool.backends:
            self._apply(backend)

    def _apply(self, backend: Backend) -> None:
        name = backend.name
        # What the engine held beyond our requests and the other gateways' at the scrape.
        outside = max(0, self._engine_others.get(name, 0) - self._fleet_at_scrape.get(name, 0))
        backend.load_sampled(self._fleet.get(name, 0) + outside)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.scrape_all()
            except Exception:  # a scrape must never stop the loop
                log.exception("engine load scrape failed")
