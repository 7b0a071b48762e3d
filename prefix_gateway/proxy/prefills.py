"""Prefills in progress: a request whose prefix a stream is computing on its replica waits for
that stream's first byte, at most `--prefill-wait` seconds, then finds the prefix cached
instead of computing it again (docs/routing.md). A stream of this process is waited for by
its event; in a fleet on one Redis, a stream of another gateway computing the request's shared
prompt is polled for until its gateway says its prefill is over.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from prefix_gateway.metrics import Metrics
from prefix_gateway.state.agreement import FleetPrefills, SharedPrompt

# How often a request waiting for another gateway's prefill asks whether it is over: a small
# part of what prefilling a shared prompt takes, few enough round trips for the rare request
# that waits.
_FLEET_POLL_SECONDS = 0.01


class Computing:
    """One attempt computing blocks `first_block...` of `chain` on `backend`."""

    __slots__ = ("backend", "chain", "done", "first_block", "shared")

    def __init__(
        self,
        backend: str,
        chain: Sequence[int],
        first_block: int,
        shared: SharedPrompt | None = None,
    ) -> None:
        self.backend = backend
        self.chain = chain
        self.first_block = first_block
        self.shared = shared
        """The shared prompt it computes for the fleet's gateways to wait for, if any."""
        self.done = asyncio.Event()

    def computes(self, chain: Sequence[int], depth: int) -> bool:
        """Whether this computes block `depth - 1` of `chain`, and so (chained) its prefix."""
        last = depth - 1
        return self.first_block <= last < len(self.chain) and self.chain[last] == chain[last]


class Prefills:
    def __init__(
        self, max_wait: float, metrics: Metrics, fleet: FleetPrefills | None = None
    ) -> None:
        """`fleet`: where the fleet's streams compute shared prompts (None: one gateway)."""
        self.max_wait = max_wait
        self._metrics = metrics
        self._fleet = fleet
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
        self._waited(began, outcome)

    async def wait_for_fleet(self, shared: SharedPrompt, backend: str) -> None:
        """Wait while another gateway's stream computes `shared` on `backend`, at most
        `--prefill-wait` seconds; counted when it was still computing."""
        fleet = self._fleet
        if fleet is None or not await fleet.computing(shared, backend):
            return
        began = time.perf_counter()
        outcome = "timeout"
        try:
            async with asyncio.timeout(self.max_wait):
                while True:
                    await asyncio.sleep(_FLEET_POLL_SECONDS)
                    if not await fleet.computing(shared, backend):
                        outcome = "computed"
                        break
        except TimeoutError:
            pass
        self._waited(began, outcome)

    def _waited(self, began: float, outcome: str) -> None:
        self._metrics.prefill_waits.labels(outcome).inc()
        self._metrics.prefill_wait_seconds.observe(time.perf_counter() - began)

    def begin(
        self,
        backend: str,
        chain: Sequence[int],
        first_block: int,
        shared: SharedPrompt | None = None,
    ) -> Computing:
        """A stream computes `chain` from `first_block` on `backend`; with `shared` (a shared
        prompt it computes part of), the fleet's gateways hear of it too."""
        fleet = self._fleet
        if fleet is None or shared is None or first_block >= shared.blocks:
            shared = None
        else:
            fleet.started(shared, backend)
        entry = Computing(backend, chain, first_block, shared)
        self._by_backend.setdefault(backend, []).append(entry)
        return entry

    def end(self, entry: Computing) -> None:
        entry.done.set()
        if entry.shared is not None and self._fleet is not None:
            self._fleet.done(entry.shared, entry.backend)
        running = self._by_backend.get(entry.backend)
        if running is not None:
            running.remove(entry)
            if not running:
                del self._by_backend[entry.backend]
