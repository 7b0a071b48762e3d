"""Service discovery: replicas that join and leave while the gateway serves.

Two sources besides the static `--backend` list:

- DNS (`--backend-dns [MODEL=]HOST:PORT`): the A and AAAA records of a headless Service,
  looked up every `discovery_interval` seconds.
- Kubernetes (`--k8s-service [MODEL=]NAME[:PORT]`): the Service's EndpointSlices, listed and
  then watched with the pod's service account; only endpoints that are ready and not
  terminating are replicas.

Each source reconciles the addresses it sees into the BackendPool through a `Membership`: a new
address is added and probed at once; an address that is gone is drained (no new requests, those
in flight finish, at most `drain_timeout` seconds) and then removed. Backends that another
source added are never touched. The hash ring is keyed by backend names, so a replica joining
or leaving moves only its own share of keys. A failed lookup or a broken watch leaves the
membership as it was: a replica is removed only when its source says it is gone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections.abc import Callable, Coroutine, Iterable, Mapping
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import dns.asyncresolver
import dns.exception
import dns.nameserver
import dns.resolver
import httpx
import orjson

from gateway.backends.pool import Backend, BackendPool, parse_backend_spec
from gateway.config import ConfigError, Settings

log = logging.getLogger("gateway.backends.discovery")

ProbeBackend = Callable[[Backend], Coroutine[Any, Any, None]]

_WATCH_SECONDS = 300
_FIRST_SYNC_SECONDS = 5.0


@dataclass(frozen=True)
class Target:
    """What one discovery flag names: a host or Service, a port, and optionally a model."""

    host: str
    port: str
    model: str | None = None

    @classmethod
    def parse(cls, spec: str, port_required: bool) -> Target:
        model: str | None = None
        rest = spec.strip()
        if "=" in rest:
            model, rest = (part.strip() for part in rest.split("=", 1))
        host, separator, port = rest.removeprefix("http://").rpartition(":")
        if not separator:
            host, port = port, ""
        if not host or (port_required and not port.isdigit()):
            form = "[MODEL=]HOST:PORT" if port_required else "[MODEL=]NAME[:PORT]"
            raise ConfigError(f"{spec!r} is not {form}")
        return cls(host, port, model or None)


def address_url(address: str, port: int | str) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{port}"


class Membership:
    """One source's replicas in the pool: adds those that appear, drains those that go."""

    def __init__(
        self,
        pool: BackendPool,
        source: str,
        model: str | None,
        probe: ProbeBackend,
        drain_timeout: float,
    ) -> None:
        self._pool = pool
        self.source = source
        self._model = model
        self._probe = probe
        self._drain_timeout = drain_timeout
        self._tasks: set[asyncio.Task[Any]] = set()
        self._probes: set[asyncio.Task[Any]] = set()

    def update(self, urls: Iterable[str]) -> None:
        wanted: dict[str, Backend] = {}
        for url in urls:
            backend = parse_backend_spec(f"{self._model}={url}" if self._model else url)
            backend.source = self.source
            wanted[backend.name] = backend
        for name, backend in wanted.items():
            existing = self._pool.get(name)
            if existing is None:
                self._pool.add(backend)
                log.warning("backend %s joined (%s)", name, self.source)
                self._probes.add(self._spawn(self._probe(backend)))
            elif existing.source != self.source:
                log.debug("%s: %s is already a backend from %s", self.source, name, existing.source)
            elif existing.draining:
                log.warning("backend %s is back (%s)", name, self.source)
                self._pool.undrain(existing)
        for backend in list(self._pool.backends):
            gone = backend.name not in wanted and not backend.draining
            if gone and backend.source == self.source:
                log.warning("backend %s left (%s)", backend.name, self.source)
                self._pool.start_drain(backend.name)
                self._spawn(self._pool.finish_drain(backend, self._drain_timeout))

    def _spawn(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(self._probes.discard)
        return task

    async def probed(self) -> None:
        """Wait for the first probe of every backend added so far."""
        await asyncio.gather(*self._probes, return_exceptions=True)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class Source(Protocol):
    membership: Membership

    async def sync(self) -> None:
        """Look once and update the membership; raise when the source cannot be read."""
        ...

    async def run(self) -> None:
        """Follow the source until cancelled."""
        ...

    async def close(self) -> None: ...


def build_resolver(nameserver: str) -> dns.asyncresolver.Resolver:
    """The system's resolver (with its search domains), or one DNS server given as HOST:PORT."""
    if not nameserver:
        return dns.asyncresolver.Resolver()
    host, port = nameserver, "53"
    if nameserver.startswith("["):
        host, _, port = nameserver[1:].partition("]")
        port = port.lstrip(":") or "53"
    elif nameserver.count(":") == 1:
        host, port = nameserver.split(":")
    if not port.isdigit():
        raise ConfigError(f"dns_nameserver {nameserver!r} is not HOST[:PORT]")
    resolver = dns.asyncresolver.Resolver(configure=False)
    resolver.nameservers = [dns.nameserver.Do53Nameserver(host, int(port))]
    return resolver


class DnsSource:
    """A headless Service's A/AAAA records, looked up on an interval."""

    def __init__(
        self,
        target: Target,
        membership: Membership,
        resolver: dns.asyncresolver.Resolver,
        interval: float,
    ) -> None:
        self.target = target
        self.membership = membership
        self._resolver = resolver
        self._interval = interval

    async def sync(self) -> None:
        addresses: set[str] = set()
        for rdtype in ("A", "AAAA"):
            try:
                answer = await self._resolver.resolve(
                    self.target.host, rdtype, search=True, lifetime=self._interval
                )
            except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
                continue
            addresses.update(str(record.address) for record in answer)
        self.membership.update(address_url(address, self.target.port) for address in addresses)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.sync()
            except dns.exception.DNSException as exc:
                log.warning("cannot resolve %s: %s", self.target.host, exc)

    async def close(self) -> None:
        await self.membership.close()


@dataclass(frozen=True)
class KubernetesAccess:
    """Where the API server is and how to authenticate to it (the pod's service account)."""

    api_url: str
    namespace: str
    token_path: Path
    ca_path: Path

    @classmethod
    def from_settings(cls, settings: Settings, environ: Mapping[str, str]) -> KubernetesAccess:
        credentials = Path(settings.k8s_credentials)
        api_url = settings.k8s_api_url
        if not api_url:
            host = environ.get("KUBERNETES_SERVICE_HOST")
            if not host:
                raise ConfigError("not inside a Kubernetes pod: give --k8s-api-url")
            api_url = address_url(host, environ.get("KUBERNETES_SERVICE_PORT", "443"))
            api_url = "https://" + api_url.removeprefix("http://")
        namespace = settings.k8s_namespace
        if not namespace:
            try:
                namespace = (credentials / "namespace").read_text(encoding="utf-8").strip()
            except OSError as exc:
                raise ConfigError(f"no pod namespace ({exc}): give --k8s-namespace") from exc
        return cls(api_url.rstrip("/"), namespace, credentials / "token", credentials / "ca.crt")

    def headers(self) -> dict[str, str]:
        """Read the token anew each time: the kubelet rotates it on disk."""
        try:
            token = self.token_path.read_text(encoding="utf-8").strip()
        except OSError:
            return {}
        return {"Authorization": f"Bearer {token}"}

    def client(self) -> httpx.AsyncClient:
        verify: ssl.SSLContext | bool = True
        if self.api_url.startswith("https://") and self.ca_path.exists():
            verify = ssl.create_default_context(cafile=str(self.ca_path))
        timeout = httpx.Timeout(10.0, read=_WATCH_SECONDS + 30.0)
        return httpx.AsyncClient(base_url=self.api_url, verify=verify, timeout=timeout)


class _Expired(Exception):
    """The watch's resource version is too old (410 Gone): list again."""


class KubernetesSource:
    """A Service's EndpointSlices: listed, then watched; ready endpoints are replicas."""

    def __init__(
        self,
        target: Target,
        membership: Membership,
        access: KubernetesAccess,
        interval: float,
    ) -> None:
        self.target = target
        self.membership = membership
        self._access = access
        self._interval = interval
        self._client = access.client()
        self._path = f"/apis/discovery.k8s.io/v1/namespaces/{access.namespace}/endpointslices"
        self._selector = f"kubernetes.io/service-name={target.host}"
        self._slices: dict[str, set[str]] = {}
        self._version: str | None = None

    async def sync(self) -> None:
        response = await self._client.get(
            self._path, params={"labelSelector": self._selector}, headers=self._access.headers()
        )
        response.raise_for_status()
        listing = response.json()
        self._slices = {
            item["metadata"]["name"]: self._urls(item) for item in listing.get("items") or []
        }
        self._version = str(listing["metadata"]["resourceVersion"])
        self._publish()

    async def run(self) -> None:
        while True:
            try:
                if self._version is None:
                    await self.sync()
                await self._watch()
            except _Expired:
                self._version = None
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                log.warning("watching endpoints of %s failed: %r", self.target.host, exc)
                self._version = None
                await asyncio.sleep(self._interval)

    async def close(self) -> None:
        await self.membership.close()
        await self._client.aclose()

    async def _watch(self) -> None:
        params = {
            "labelSelector": self._selector,
            "watch": "true",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(_WATCH_SECONDS),
            "resourceVersion": self._version or "",
        }
        async with self._client.stream(
            "GET", self._path, params=params, headers=self._access.headers()
        ) as response:
            if response.status_code == 410:
                raise _Expired
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.strip():
                    self._apply(orjson.loads(line))

    def _apply(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        item = event["object"]
        if kind == "ERROR":
            if item.get("code") == 410:
                raise _Expired
            raise ValueError(f"watch error: {item.get('message')}")
        self._version = str(item["metadata"]["resourceVersion"])
        if kind == "BOOKMARK":
            return
        name = item["metadata"]["name"]
        if kind == "DELETED":
            self._slices.pop(name, None)
        else:
            self._slices[name] = self._urls(item)
        self._publish()

    def _publish(self) -> None:
        self.membership.update(url for urls in self._slices.values() for url in urls)

    def _urls(self, item: dict[str, Any]) -> set[str]:
        port = self._port(item.get("ports") or [])
        if port is None:
            return set()
        urls = set()
        for endpoint in item.get("endpoints") or []:
            conditions = endpoint.get("conditions") or {}
            # An unset `ready` means ready; a terminating endpoint takes no new work.
            if conditions.get("ready") is False or conditions.get("terminating") is True:
                continue
            addresses = endpoint.get("addresses") or []
            if addresses:
                urls.add(address_url(str(addresses[0]), port))
        return urls

    def _port(self, ports: list[dict[str, Any]]) -> int | None:
        wanted = self.target.port
        if wanted.isdigit():
            return int(wanted)
        for port in ports:
            if not wanted or port.get("name") == wanted:
                return int(port["port"])
        return None


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

        def membership(kind: str, target: Target) -> Membership:
            source = f"{kind}:{target.host}"
            return Membership(pool, source, target.model, probe, settings.drain_timeout)

        if settings.backend_dns:
            resolver = build_resolver(settings.dns_nameserver)
            for spec in settings.backend_dns:
                target = Target.parse(spec, port_required=True)
                sources.append(
                    DnsSource(
                        target, membership("dns", target), resolver, settings.discovery_interval
                    )
                )
        if settings.k8s_service:
            access = KubernetesAccess.from_settings(settings, environ)
            for spec in settings.k8s_service:
                target = Target.parse(spec, port_required=False)
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
