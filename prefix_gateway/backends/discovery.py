"""Service discovery: replicas that join and leave while the gateway serves (docs/deploy.md).

Each source (DNS records, Kubernetes EndpointSlices) reconciles what it sees into the pool
through a `Membership`; a failed lookup or a broken watch changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from contextlib import suppress

from prefix_gateway.backends.dns import DnsSource, build_resolver
from prefix_gateway.backends.kubernetes import KubernetesAccess, KubernetesSource
from prefix_gateway.backends.membership import Membership, ProbeBackend, ServiceSpec, Source
from prefix_gateway.backends.pool import BackendPool
from prefix_gateway.config import Settings

log = logging.getLogger("prefix_gateway.backends.discovery")

_FIRST_SYNC_SECONDS = 5.0


class Discovery:
    """Every discovery source of one gateway, started and stopped with it."""

    def __init__(self, sources: list[Source], retry_seconds: float = 10.0) -> None:
        self.sources = sources
        self._retry_seconds = retry_seconds
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    def build(
        cls,
        settings: Settings,
        pool: BackendPool,
        probe: ProbeBackend,
        environ: Mapping[str, str] | None = None,
    ) -> Discovery:
        environ = os.environ if environ is None else environ
        sources: list[Source] = []

        def membership(kind: str, target: ServiceSpec) -> Membership:
            source = f"{kind}:{target.host}"
            return Membership(pool, source, target.model, probe, settings.drain_timeout)

        if settings.backend_dns:
            resolver = build_resolver(settings.dns_nameserver)
            for spec in settings.backend_dns:
                target = ServiceSpec.parse(spec, port_required=True)
                sources.append(
                    DnsSource(
                        target, membership("dns", target), resolver, settings.discovery_interval
                    )
                )
        if settings.k8s_service:
            access = KubernetesAccess.from_settings(settings, environ)
            for spec in settings.k8s_service:
                target = ServiceSpec.parse(spec, port_required=False)
                sources.append(
                    KubernetesSource(
                        target, membership("k8s", target), access, settings.discovery_interval
                    )
                )
        return cls(sources, settings.discovery_interval)

    async def start(self) -> None:
        """Look once (bounded) so the gateway starts with replicas, then follow every source."""

        async def first(source: Source) -> None:
            try:
                await asyncio.wait_for(source.sync(), _FIRST_SYNC_SECONDS)
                await source.membership.probed()
            except Exception as exc:
                log.warning("first discovery of %s failed: %r", source.membership.source, exc)

        await asyncio.gather(*(first(source) for source in self.sources))
        self._tasks = [
            asyncio.create_task(self._follow(source), name=f"discovery {source.membership.source}")
            for source in self.sources
        ]

    async def _follow(self, source: Source) -> None:
        """Run a source for as long as the gateway runs: a bug in one look must not end it."""
        while True:
            try:
                await source.run()
            except Exception:
                log.exception("discovery of %s failed; retrying", source.membership.source)
                await asyncio.sleep(self._retry_seconds)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with suppress(asyncio.CancelledError):
                await task
        await asyncio.gather(*(source.close() for source in self.sources))
