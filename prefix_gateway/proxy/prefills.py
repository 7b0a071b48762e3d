"""Prefills in progress: a request whose prefix a stream is computing on its replica waits for
that stream's first byte, at most `--prefill-wait` seconds, then finds the prefix cached
instead of computing it again (docs/routing.md). Per process.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from prefix_gateway.metrics import Metrics


class Computing:
    """One attempt computing blocks `first_block...` of `chain` on `backend`."""

    __slots__ = ("backend", "chain", "done", "first_block")

    def __init__(self, backend: str, chain: Sequence[int], first_block: int) -> None:
        self.backend = backend
        self.chain = chain
        self.first_block = first_block
        self.done = asyncio.Event()

    def computes(self, chain: Sequence[int], depth: int) -> bool:
        """Whether this computes block `depth - 1` of `chain`, and so (chained) its prefix."""
        last = depth - 1
        return self.first_block <= last < len(self.chain) and self.chain[last] == chain[last]


class Prefills:
    def __init__(self, max_wait: float, metrics: Metrics) -> None:
        self.max_wait = max_wait
        self._metrics = metrics
        self._by_backend: dict[str, list[Computing]] = {}

    def earlier(self, backend: str, chain: Sequence[int], depth: int) -> asyncio.Event | None:
        """The first-byte event of a stream computing `chain` up to `depth` on `backend` now."""
        running = self._by_backend.get(backend)
        if not running or depth <= 0:
            return None
        for item in running:
            if not item.done.is_set() and item.computes(chain, depth):
                return item.done
        return None

    async def wait(self, done: asyncio.Event) -> None:
        """Wait for `done` (from `earlier`), at most `--prefill-wait` seconds; counted."""
        began = time.perf_counter()
        outcome = "computed"
        try:
            async with asyncio.timeout(self.max_wait):  # `wait_for` may swallow a cancellation
                await done.wait()
        except TimeoutError:
            outcome = "timeout"
        self._metrics.prefill_waits.labels(outcome).inc()
        self._metrics.prefill_wait_seconds.observe(time.perf_counter() - began)

    def begin(self, backend: str, chain: Sequence[int], first_block: int) -> Computing:
        entry = Computing(backend, chain, first_block)
        self._by_backend.setdefault(backend, []).append(entry)
        return entry

    def end(self, entry: Computing) -> None:
        entry.done.set()
        running = self._by_backend.get(entry.backend)
        if running is not None:
            running.remove(entry)
            if not running:
                del self._by_backend[entry.backend]
