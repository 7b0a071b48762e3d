"""Prefills in progress: a request whose prefix is being computed on its replica waits for it.

The index records a prompt when it is routed, so the next request sharing it is sent to the
same replica at once — often while the first is still in prefill. An engine finds in its
prefix cache only blocks already computed: sent at once, the second request computes the whole
shared prefix a second time, on the same replica, at the same moment. Held until the first
request's first token comes back (its prefill is done), it finds the prefix cached and computes
only its own part; its time to first token is about what computing the prefix itself would
have cost, and the replica's compute is saved.

A streamed request announces its first token with its first chunk; a plain one only with its
whole answer, so only streams count as prefills in progress here. A request waits at most
`--prefill-wait` seconds, and never for a request that is itself waiting.

Per process: a fleet of gateways (or workers) sees only its own requests in progress.
"""

from __future__ import annotations

import asyncio
import time

from gateway.metrics import Metrics
from gateway.routing.router import RoutedRequest


class _Computing:
    __slots__ = ("backend", "done", "first_block", "hashes")

    def __init__(self, backend: str, hashes: list[int], first_block: int) -> None:
        self.backend = backend
        self.hashes = hashes
        self.first_block = first_block
        """The first block this request computes (the ones before were cached)."""
        self.done = asyncio.Event()

    def computes(self, hashes: list[int], depth: int) -> bool:
        """Whether this request computes block `depth - 1` of `hashes` (chained: so the whole
        prefix up to it is the same)."""
        last = depth - 1
        return self.first_block <= last < len(self.hashes) and self.hashes[last] == hashes[last]


class Prefills:
    def __init__(self, max_wait: float, metrics: Metrics) -> None:
        self._max_wait = max_wait
        self._metrics = metrics
        self._by_backend: dict[str, list[_Computing]] = {}

    def earlier(self, routed: RoutedRequest) -> asyncio.Event | None:
        """The first-byte event of a stream computing `routed`'s matched prefix on its
        backend now, if there is one: `routed` should wait for it."""
        running = self._by_backend.get(routed.backend.name)
        depth = routed.decision.matched_blocks
        if not running or depth <= 0:  # `begin` registers nothing when waits are off
            return None
        hashes = routed.hashes
        for item in running:
            if not item.done.is_set() and item.computes(hashes, depth):
                return item.done
        return None

    async def wait(self, done: asyncio.Event) -> None:
        """Wait for `done` (from `earlier`), at most `--prefill-wait` seconds; counted."""
        began = time.perf_counter()
        outcome = "computed"
        try:
            await asyncio.wait_for(done.wait(), self._max_wait)
        except TimeoutError:
            outcome = "timeout"
        self._metrics.prefill_waits.labels(outcome).inc()
        self._metrics.prefill_wait_seconds.observe(time.perf_counter() - began)

    def begin(self, routed: RoutedRequest) -> _Computing | None:
        """While `routed` runs, the blocks past its cached depth count as being computed on
        its backend, until its first byte (`RoutedRequest.reached_first_byte`) or `end`."""
        hashes = routed.hashes
        first_block = routed.decision.matched_blocks
        if self._max_wait <= 0 or not routed.input.stream or first_block >= len(hashes):
            return None
        entry = _Computing(routed.backend.name, hashes, first_block)
        self._by_backend.setdefault(entry.backend, []).append(entry)
        routed.prefilled = entry.done
        return entry

    def end(self, entry: _Computing | None) -> None:
        if entry is None:
            return
        entry.done.set()
        running = self._by_backend.get(entry.backend)
        if running is not None:
            running.remove(entry)
            if not running:
                del self._by_backend[entry.backend]
