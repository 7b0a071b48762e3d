"""Discovery in Kubernetes: a Service's EndpointSlices, watched with the pod's service account."""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson

from prefix_gateway.backends.membership import Membership, ServiceSpec, address_url
from prefix_gateway.config import ConfigError, Settings

log = logging.getLogger("prefix_gateway.backends.discovery")

_WATCH_SECONDS = 300


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
        target: ServiceSpec,
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
