"""Stalled replicas: alive to health checks, dead to inference.

A replica whose HTTP server still answers `/health` while its engine is stuck (a hung kernel
or collective, an engine loop that died) is found from progress, not from probes: it is
stalled when requests are on it (waiting for a first byte, or streaming to a client that
reads) and it has produced nothing at all (no byte of any response, no token in its engine's
counter) for longer than `min_seconds`, and, when requests wait for a first byte, much longer
than the fleet's recent prefill speed explains for the work queued ahead of the oldest of them
(`factor` times that). A stream whose client stopped reading holds its replica back (TCP
backpressure) and is no evidence against it.
A long prefill is not a stall: it is expected to take long, and other requests' tokens keep
coming meanwhile.

A stalled replica leaves routing at once; its requests without a first byte move to other
replicas, its streams end with an SSE error. Only an inference probe (a one-token completion)
brings it back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import suppress
from dataclasses import dataclass

from prefix_gateway.backends.backend import Backend, Work
from prefix_gateway.backends.health import Health
from prefix_gateway.backends.pool import BackendPool
from prefix_gateway.backends.prefill_speed import PrefillSpeed
from prefix_gateway.metrics import Metrics

log = logging.getLogger("prefix_gateway.backends.stalls")

_GUESS_TOKENS_PER_SECOND = 1_000.0
"""Before any first byte: slower than any engine prefills, GPU or CPU."""


@dataclass(frozen=True)
class StallRule:
    min_seconds: float
    factor: float
    scrape_lag: float = 0.0
    """How late the engine's own counter can show progress: without a stream of this
    gateway's running there, a wait is judged only once that much longer."""

    def verdict(
        self, now: float, work: set[Work], progressed_at: float, speed: PrefillSpeed
    ) -> str | None:
        """Why the replica doing `work` is stalled, or None. Work waiting on its client is
        left out: a replica whose client does not read cannot send, and is not to blame."""
        judged = [item for item in work if not item.awaiting_client]
        if not judged:
            return None
        waiting = [item for item in judged if not item.first_byte_at]
        # Silent since its last progress, or since its oldest judged work began if later.
        silent = now - max(progressed_at, min(item.judged_from for item in judged))
        limit = self.min_seconds
        if waiting:
            ahead = min(waiting, key=lambda item: item.sent_at).blocks_ahead
            limit = max(limit, self.factor * speed.expected(ahead))
        if len(waiting) == len(judged):  # no stream here to show progress as it happens
            limit += self.scrape_lag
        if silent <= limit:
            return None
        return f"nothing produced for {silent:.1f} s (limit {limit:.1f} s) while requests wait"


class StallWatch:
    """Checks every serving backend a few times per `min_seconds`."""

    def __init__(
        self,
        pool: BackendPool,
        health: Health,
        rule: StallRule,
        metrics: Metrics,
        block_tokens: int,
    ) -> None:
        self._pool = pool
        self._health = health
        self._rule = rule
        self._metrics = metrics
        self.speed = PrefillSpeed(_GUESS_TOKENS_PER_SECOND / block_tokens)
        self._interval = max(0.05, rule.min_seconds / 6)
        self._task: asyncio.Task[None] | None = None

    def check(self, now: float) -> list[Backend]:
        """Take every stalled backend out, and stop its work; the backends taken out."""
        found = []
        for backend in self._pool.backends:
            if backend.stalled or not backend.healthy or not backend.work:
                continue
            why = self._rule.verdict(now, backend.work, backend.progressed_at, self.speed)
            if why is not None:
                self._metrics.stalls.labels(backend.name).inc()
                self._health.stalled(backend, why)
                for item in list(backend.work):
                    item.stop()
                found.append(backend)
        return found

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="stall-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                self.check(time.monotonic())
            except Exception:  # keep watching whatever one backend did
                log.exception("stall check failed")
