"""The fleet under `/admin/backends`: list, add, drain and remove replicas while serving
(docs/deploy.md). The access check is a dependency handed in.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import asdict
from typing import Any
from urllib.parse import urlsplit

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from prefix_gateway.backends.backend import Backend
from prefix_gateway.backends.kv_events import FeedState
from prefix_gateway.backends.pool import parse_backend_spec
from prefix_gateway.components import Components
from prefix_gateway.config import ConfigError
from prefix_gateway.control.access import AdminRoute, Guard
from prefix_gateway.doctor.verdicts import Status
from prefix_gateway.doctor.watch import Examination
from prefix_gateway.errors import BadRequest, GatewayError, NotFound


class Conflict(GatewayError):
    status = 409
    error_type = "invalid_request_error"


class NewBackend(BaseModel):
    url: str
    model: str | None = None
    upstream_key: bool = False
    """Send it `--upstream-api-key`: a backend added at run time gets it only when asked."""


def backend_view(
    backend: Backend, feed: FeedState | None = None, examined: Examination | None = None
) -> dict[str, Any]:
    """A backend as listed: `models` its base models, `adapters` its LoRA adapters with their
    base model; `kv_events` is its KV-event feed with `--kv-events`, else null; `checks` the
    doctor's last examination of it, null before the first."""
    return {
        "name": backend.name,
        "url": backend.url,
        "models": sorted(backend.models - backend.parents.keys()),
        "adapters": dict(sorted(backend.parents.items())),
        "pinned_model": backend.pinned_model,
        "healthy": backend.healthy,
        "stalled": backend.stalled,
        "ejected": backend.ejected_why or None,
        "last_probe_error": backend.last_probe_error or None,
        "draining": backend.draining,
        "in_flight": backend.in_flight,
        "queued": backend.queued,
        "load": backend.load,
        "pending_prefill_blocks": backend.pending_prefill,
        "source": backend.source,
        "upstream_key": backend.credentialed,
        "kv_events": asdict(feed) if feed is not None else None,
        "checks": examination_view(examined) if examined is not None else None,
    }


def examination_view(examined: Examination) -> dict[str, Any]:
    return {
        "at": examined.at,
        "passed": all(result.status is not Status.FAIL for result in examined.results),
        "results": {
            result.check.value: {"status": result.status.value, "detail": result.detail}
            for result in examined.results
        },
    }


def build_backends_router(components: Components, guard: Guard) -> APIRouter:
    pool = components.pool
    settings = components.settings
    drain_timeout = settings.drain_timeout
    drains: set[asyncio.Task[bool]] = set()
    router = APIRouter(
        prefix="/admin/backends",
        tags=["admin"],
        route_class=AdminRoute,
        dependencies=[Depends(guard)],
    )

    def view(backend: Backend) -> dict[str, Any]:
        feeds = components.kv_events
        feed = feeds.state(backend.name) if feeds is not None else None
        doctor = components.doctor
        examined = doctor.examinations.get(backend.name) if doctor is not None else None
        return {
            **backend_view(backend, feed, examined),
            "public_name": components.proxy.public_names.name_of(backend.name),
        }

    def find(name: str) -> Backend:
        backend = pool.get(name)
        if backend is None:
            raise NotFound(f"no backend named {name!r}", param="name", code="backend_not_found")
        return backend

    @router.get("")
    async def list_backends() -> JSONResponse:
        """Every backend: health, load, models, draining, and who added it."""
        return JSONResponse({"object": "list", "data": [view(item) for item in pool.backends]})

    @router.post("", status_code=201)
    async def add_backend(new: NewBackend) -> JSONResponse:
        """Add a replica; it serves `model` only when given, else what its /v1/models lists."""
        spec = f"{new.model}={new.url}" if new.model else new.url
        if any(char.isspace() or not char.isprintable() for char in spec):
            raise BadRequest(
                "the URL or model holds whitespace or control characters",
                param="url",
                code="invalid_backend",
            )
        try:
            backend = parse_backend_spec(spec, source="admin")
        except ConfigError as exc:
            raise BadRequest(str(exc), param="url", code="invalid_backend") from exc
        if _is_gateway(backend.url, settings.host, settings.port):
            raise BadRequest(
                "that URL is this gateway: a request sent there would come back",
                param="url",
                code="invalid_backend",
            )
        backend.credentialed = new.upstream_key
        if pool.get(backend.name) is not None:
            raise Conflict(f"backend {backend.name} is already in the pool", code="backend_exists")
        pool.add(backend)
        await components.monitor.refresh(backend)
        return JSONResponse(view(backend), status_code=201)

    @router.post("/{name}/drain", status_code=202)
    async def drain_backend(name: str, wait: bool = False) -> JSONResponse:
        """Stop new requests to `name`, let those in flight finish, then remove it."""
        backend = find(name)
        pool.start_drain(name)
        task = asyncio.create_task(pool.finish_drain(backend, drain_timeout))
        drains.add(task)
        task.add_done_callback(drains.discard)
        if wait:
            removed = await asyncio.shield(task)
            return JSONResponse({**view(backend), "removed": removed})
        return JSONResponse({**view(backend), "removed": False}, status_code=202)

    @router.delete("/{name}")
    async def remove_backend(name: str) -> JSONResponse:
        """Remove `name` now; requests already sent to it are not cut off."""
        backend = find(name)
        pool.remove(name)
        return JSONResponse({**view(backend), "removed": True})

    return router


_LOCAL = frozenset({"localhost", "0.0.0.0", "::", socket.gethostname().lower()})


def _is_gateway(url: str, listen_host: str, listen_port: int) -> bool:
    """Whether `url` names this gateway's own listener (the Via header catches the rest)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = (parts.hostname or "").lower()
    if port != listen_port:
        return False
    if host == listen_host.lower() or host in _LOCAL:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
