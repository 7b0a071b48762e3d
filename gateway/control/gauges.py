"""Gauges read from the live state of one gateway process: set just before a scrape renders.

A single process sets them when `/metrics` is asked for. Under several workers a scrape reads
every worker's values from the multiprocess files, so each worker also publishes its own every
second (see `gateway.server`); another worker's value is then at most that old.
"""

from __future__ import annotations

from gateway.components import Components


def publish_scrape_gauges(components: Components) -> None:
    metrics = components.metrics
    backends = components.pool.backends
    metrics.set_per_label(
        metrics.in_flight, {backend.name: backend.in_flight for backend in backends}
    )
    serving = {backend.name: backend.healthy and not backend.draining for backend in backends}
    metrics.set_per_label(metrics.healthy, {name: int(up) for name, up in serving.items()})
    metrics.set_per_label(metrics.queued, {backend.name: backend.queued for backend in backends})
    metrics.set_per_label(
        metrics.pending_prefill, {backend.name: backend.pending_prefill for backend in backends}
    )
    metrics.set_per_label(metrics.load_bound, components.router.load_bounds())
    metrics.conversations.set(len(components.router.conversations))
    size = getattr(components.index, "__len__", None)
    if size is not None:
        metrics.index_blocks.set(size())
