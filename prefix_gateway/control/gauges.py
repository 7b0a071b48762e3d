"""Gauges read from one gateway process's live state, set just before a scrape renders (and,
under several workers, published every second from `prefix_gateway.server`).
"""

from __future__ import annotations

from prefix_gateway.components import Components


def publish_scrape_gauges(components: Components) -> None:
    metrics = components.metrics
    pool = components.pool
    backends = pool.backends
    metrics.set_per_label(
        metrics.in_flight, {backend.name: backend.in_flight for backend in backends}
    )
    serving = {backend.name: backend.healthy and not backend.draining for backend in backends}
    metrics.set_per_label(metrics.healthy, {name: int(up) for name, up in serving.items()})
    metrics.set_per_label(metrics.queued, {backend.name: backend.queued for backend in backends})
    metrics.set_per_label(
        metrics.stalled, {backend.name: int(backend.stalled) for backend in backends}
    )
    metrics.set_per_label(
        metrics.pending_prefill, {backend.name: backend.pending_prefill for backend in backends}
    )
    metrics.set_per_label(metrics.load_bound, components.router.load_bounds())
    _publish_leases(components)
    metrics.set_per_label(metrics.adapters.replicas, _adapter_replicas(components))
    metrics.process.refresh()
    metrics.conversations.set(len(components.router.memory.conversations))
    size = getattr(components.index, "__len__", None)
    if size is not None:
        metrics.index_blocks.set(size())


def _publish_leases(components: Components) -> None:
    """What the requests in progress hold."""
    proxy, leases = components.proxy, components.metrics.leases
    leases.admitted.set(proxy.admission.active)
    flow = proxy.flow
    leases.waiting.labels("admission").set(proxy.admission.waiting)
    leases.waiting.labels("flow").set(0 if flow is None else flow.waiting)
    leases.body_bytes.set(proxy.bodies.held)
    leases.open_placements.set(proxy.open_placements)
    reserved = proxy.reserved_tokens()
    if reserved:
        components.metrics.set_per_label(components.metrics.tenants.reserved_tokens, reserved)


def _adapter_replicas(components: Components) -> dict[str, int]:
    """Replicas serving each adapter a replica lists or `lora_adapters` declares."""
    pool = components.pool
    known = set(pool.adapters())
    if components.adapters is not None:
        known.update(components.adapters.declared())
    replicas = {}
    for name in known:
        serving = pool.serving(name)
        replicas[name] = len(serving.names) if serving is not None else 0
    return replicas
