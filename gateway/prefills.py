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
from collections.abc import Iterator
from contextlib import contextmanager

from gateway.metrics import Metrics
from gateway.router import RoutedRequest


class _Computing:
    __slots__ = ("done", "first_block", "hashes")

    def __init__(self, hashes: list[int], first_block: int) -> None:
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

    async def wait(self, routed: RoutedRequest) -> None:
        """Hold `routed` while its matched prefix is being computed on its backend."""
        depth = routed.decision.matched_blocks
        if self._max_wait <= 0 or depth <= 0:
            return
        running = self._by_backend.get(routed.backend.name)
        if not running:
            return
        hashes = routed.hashes
        earlier = next(
            (item for item in running if not item.done.is_set() and item.computes(hashes, depth)),
            None,
        )
        if earlier is None:
            return
        began = time.perf_counter()
        outcome = "computed"
        try:
            await asyncio.wait_for(earlier.done.wait(), self._max_wait)
        except TimeoutError:
            outcome = "timeout"
        self._metrics.prefill_waits.labels(outcome).inc()
        self._metrics.prefill_wait_seconds.observe(time.perf_counter() - began)

    @contextmanager
    def computing(self, routed: RoutedRequest) -> Iterator[None]:
        """While `routed` runs, the blocks past its cached depth count as being computed on
        its backend, until its first byte (`RoutedRequest.reached_first_byte`) or its end."""
        hashes = routed.hashes
        first_block = routed.decision.matched_blocks
        if self._max_wait <= 0 or not routed.input.stream or first_block >= len(hashes):
            yield
            return
        entry = _Computing(hashes, first_block)
        name = routed.backend.name
        running = self._by_backend.setdefault(name, [])
        running.append(entry)
        routed.prefilled = entry.done
        try:
            yield
        finally:
            entry.done.set()
            running.remove(entry)
            if not running and self._by_backend.get(name) is running:
                del self._by_backend[name]
