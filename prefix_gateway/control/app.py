"""The control plane on FastAPI: models, health, readiness and metrics. The inference
endpoints take the lean path in `prefix_gateway.proxy.handler` instead.
"""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from prefix_gateway.auth import KEY_POSITION, AdminAccess
from prefix_gateway.components import Components
from prefix_gateway.control.access import admin_guard, error_response
from prefix_gateway.control.backends import build_backends_router
from prefix_gateway.control.bodies import BoundedBodies
from prefix_gateway.control.explain import build_explain_router
from prefix_gateway.control.gauges import publish_scrape_gauges
from prefix_gateway.control.tenants import build_tenants_router
from prefix_gateway.errors import BadRequest
from prefix_gateway.refusals import of_status


def build_control_app(components: Components) -> FastAPI:
    # No /docs or /redoc: their pages load scripts from a CDN. Without slash redirects, whose
    # Location would be built from the client's Host, a path with a trailing slash is a 404.
    app = FastAPI(title="Prefix Gateway", docs_url=None, redoc_url=None, redirect_slashes=False)
    settings = components.settings
    app.add_middleware(
        BoundedBodies,
        max_body_bytes=settings.max_body_bytes,
        max_pending_body_bytes=settings.max_pending_body_bytes,
    )
    guard = admin_guard(AdminAccess(settings.admin_token, settings.host))
    app.include_router(build_explain_router(components, guard))
    app.include_router(build_backends_router(components, guard))
    app.include_router(build_tenants_router(components, guard))
    pool = components.pool
    metrics = components.metrics

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> Response:
        given = (exc.headers or {}).items()
        headers = tuple((name.encode("latin-1"), value.encode("latin-1")) for name, value in given)
        return error_response(of_status(exc.status_code, str(exc.detail), headers))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> Response:
        return error_response(BadRequest(str(exc.errors()), code="invalid_request"))

    first_tenant_key = len(settings.api_key)

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        """The models served now, each LoRA adapter with its base model as `parent` (those of
        `lora_adapters` too, loaded on a replica by their first request); to a named tenant
        with a `models:` list, those of them alone."""
        created = int(time.time())
        parents: dict[str, str | None] = dict.fromkeys(pool.served_models())
        parents.update(
            (adapter, base) for adapter, base in pool.adapters().items() if adapter in parents
        )
        if components.adapters is not None:
            parents.update(components.adapters.unserved())
        tenant = request.scope.get(KEY_POSITION, -1) - first_tenant_key
        allowed = settings.tenants[tenant].models if tenant >= 0 else None
        if allowed is not None:
            parents = {model: parent for model, parent in parents.items() if model in allowed}
        data = [
            {
                "id": model,
                "object": "model",
                "created": created,
                "owned_by": "prefix-gateway",
                "parent": parents[model],
            }
            for model in sorted(parents)
        ]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/health")
    async def health() -> JSONResponse:
        healthy = sum(1 for backend in pool.backends if backend.healthy)
        return JSONResponse({"status": "ok", "backends": len(pool.backends), "healthy": healthy})

    @app.get("/ready")
    async def ready(require_backend: bool = False) -> JSONResponse:
        # Ready means "this gateway can answer": without a healthy replica it still answers,
        # with a quick 503 no_healthy_backend, which a client can retry, where a pod out of the
        # Service would refuse connections. `?require_backend=true` asks for a healthy one too.
        healthy = sum(1 for backend in pool.backends if backend.healthy)
        is_ready = bool(healthy) or not require_backend
        body = {"ready": is_ready, "healthy": healthy, "backends": len(pool.backends)}
        return JSONResponse(body, status_code=200 if is_ready else 503)

    # With a metrics port of its own, the API port answers 404 for it: not in its schema either.
    @app.get("/metrics", include_in_schema=not settings.metrics_port)
    async def prometheus() -> Response:
        publish_scrape_gauges(components)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
