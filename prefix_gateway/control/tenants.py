"""`/admin/tenants`: each named tenant as this gateway process counts it (docs/tenants.md)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from prefix_gateway.components import Components
from prefix_gateway.control.access import AdminRoute, Guard


def build_tenants_router(components: Components, guard: Guard) -> APIRouter:
    router = APIRouter(
        prefix="/admin/tenants",
        tags=["admin"],
        route_class=AdminRoute,
        dependencies=[Depends(guard)],
    )

    @router.get("")
    async def list_tenants() -> JSONResponse:
        """Every named tenant (none without a `tenants:` configuration)."""
        return JSONResponse({"object": "list", "data": components.proxy.tenant_views()})

    return router
