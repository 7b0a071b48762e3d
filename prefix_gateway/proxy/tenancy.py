"""A request's life with tenants and their tokens (docs/tenants.md): which tenant a request is,
what it reserves when it is admitted and, once it ended, what it is charged and what service
the fair queue counts for it. The proxy path reaches `prefix_gateway.tenants` through this
module alone (an import contract says so).

Built where tenants are named, or flow control is on (its fair queue counts tokens as budgets
do); otherwise a request's life does none of this work.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prefix_gateway.backends.pool import BackendPool
from prefix_gateway.config import Settings
from prefix_gateway.config.tenants import ANONYMOUS
from prefix_gateway.errors import BadRequest, Headers
from prefix_gateway.metrics import Metrics
from prefix_gateway.prompt.parsing import RoutingInput
from prefix_gateway.refusals import model_not_found
from prefix_gateway.routing.types import Outcome
from prefix_gateway.state.redis import SharedState
from prefix_gateway.tenants.cost import tokens_reserved, usage_of, used_cost
from prefix_gateway.tenants.gate import TenantGate
from prefix_gateway.tenants.shared import SharedBudgets
from prefix_gateway.tenants.slots import SharedSlots
from prefix_gateway.tenants.tenant import Reservation, Tenant
from prefix_gateway.tenants.view import tenant_view


@dataclass(frozen=True)
class TenantFleet:
    """What the gateways of a fleet share of their tenants through Redis."""

    state: SharedState
    gateways: Callable[[], int | None]
    """The gateway processes of the fleet last seen (None: not known yet)."""


class Tenancy:
    def __init__(
        self, settings: Settings, metrics: Metrics, pool: BackendPool, fleet: TenantFleet | None
    ) -> None:
        self.gate = _tenant_gate(settings, metrics, fleet)
        self.pool = pool
        self.chars_per_token = settings.chars_per_token
        self.completion_default = settings.budget_max_tokens
        self.cached_cost = settings.cached_token_cost

    def account(self, key_position: int) -> Account:
        """The side of its tenant of a request sent with the client key at `key_position`."""
        gate = self.gate
        return Account(self, None if gate is None else gate.of_key(key_position))

    def views(self, waiting_of: Callable[[str], int]) -> list[dict[str, Any]]:
        """Every named tenant as `/admin/tenants` shows it, with its requests `waiting_of`."""
        gate = self.gate
        if gate is None:
            return []
        now = time.monotonic()
        return [tenant_view(tenant, now, waiting_of(tenant.name)) for tenant in gate.tenants]

    def reserved_tokens(self) -> dict[str, float]:
        """Tokens each named tenant's requests reserved and have not settled."""
        gate = self.gate
        return {} if gate is None else {tenant.name: tenant.reserved for tenant in gate.tenants}


class Account:
    """One request's side of its tenant (None: anonymous): what it reserved, held until it is
    settled, once."""

    __slots__ = ("_tenancy", "own_priority", "reservation", "reserved", "tenant")

    def __init__(self, tenancy: Tenancy, tenant: Tenant | None) -> None:
        self._tenancy = tenancy
        self.tenant = tenant
        self.reservation: Reservation | None = None
        """What its tenant holds for it: a place in flight and its tokens."""
        self.reserved = 0.0
        """The tokens it reserves, tenant or not (the fair queue's service while it runs)."""
        self.own_priority: int | None = None
        """The engine priority its client asked for, where its tenant may set its own."""

    async def admit(self, request: RoutingInput) -> None:
        """Reserve its tokens; a named tenant's place in flight and budgets take them, or a
        429 says which limit refused them. A named tenant's request owns what it stores."""
        tenancy = self._tenancy
        self.reserved = tokens_reserved(
            request,
            tenancy.chars_per_token,
            tenancy.pool.context_length(request.model),
            tenancy.completion_default,
        )
        gate, tenant = tenancy.gate, self.tenant
        if tenant is not None:
            self._within_bounds(tenant, request)
            if request.owner is None:
                # Its stored responses are its tenant's, isolated or not.
                request.owner = tenant.name
        if gate is not None and tenant is not None:
            self.reservation = await gate.admit(tenant, self.reserved)

    def _within_bounds(self, tenant: Tenant, request: RoutingInput) -> None:
        """A model its tenant may not use is one that does not exist (404); an engine
        priority it may set is taken when within its range, else refused (400)."""
        spec = tenant.spec
        models = spec.models
        if models is not None and request.model and request.model not in models:
            raise model_not_found(request.model)
        given = request.engine_fields
        bounds = spec.priority_range
        if bounds is not None and given is not None and "priority" in given:
            asked = given["priority"]
            low, high = bounds
            if isinstance(asked, bool) or not isinstance(asked, int) or not low <= asked <= high:
                raise BadRequest(
                    f"priority must be an integer from {low} to {high} for tenant"
                    f" {tenant.name} (lower is served first), not {asked!r}",
                    param="priority",
                    code="priority_out_of_range",
                )
            self.own_priority = asked

    @property
    def name(self) -> str:
        """Its tenant's name (`anonymous` for a key of `--api-key`, or none)."""
        tenant = self.tenant
        return ANONYMOUS if tenant is None else tenant.name

    @property
    def lane(self) -> tuple[str, int, float]:
        """Its tenant's line in the fair queue: name, priority, weight."""
        tenant = self.tenant
        if tenant is None:
            return ANONYMOUS, 0, 1.0
        return tenant.name, tenant.spec.priority, tenant.spec.weight

    @property
    def priority(self) -> int:
        """Its tenant's priority (higher is served first), once admitted; else 0."""
        held = self.reservation
        return 0 if held is None else held.tenant.spec.priority

    @property
    def needs_usage(self) -> bool:
        """Its tenant's token budget is charged what it used: a stream asks for its usage."""
        held = self.reservation
        return held is not None and held.tenant.tokens is not None

    def headers(self, now: float) -> Headers:
        """OpenAI's rate-limit headers of its tenant, once admitted."""
        held = self.reservation
        return () if held is None else held.tenant.headers(now)

    def settle(self, request: RoutingInput | None, status: int, outcome: Outcome | None) -> float:
        """The request ended with `status` (parsed as `request`, if it got so far), having come
        to `outcome`: its tenant settled and counted; the service it received, in tokens, as
        the fair queue counts it — what it was charged or, sent to a replica and charged
        nothing (its client left before its first byte), its prompt, which the replica was
        given to compute while its slot was held."""
        tenancy = self._tenancy
        gate = tenancy.gate
        if request is None:
            if gate is not None:
                gate.refused(self.tenant, status)
            return 0.0
        prompt = request.estimated_tokens(tenancy.chars_per_token)
        usage = usage_of(outcome, request.stream, self.reserved, prompt)
        if gate is not None:
            if self.reservation is not None or (self.tenant is None and outcome is not None):
                gate.settle(self.reservation, status, usage)
            else:
                gate.refused(self.tenant, status)
        if usage is None:
            return prompt if outcome is not None and outcome.tried else 0.0
        return used_cost(usage, tenancy.cached_cost)


def _tenant_gate(
    settings: Settings, metrics: Metrics, fleet: TenantFleet | None
) -> TenantGate | None:
    """The tenants' gate where tenants are named: budgets and caps on requests in flight kept
    by this process, or by the fleet through Redis."""
    if not settings.tenants:
        return None
    budgets = slots = None
    if fleet is not None:
        link = fleet.state.link
        budgets = SharedBudgets(fleet.state.budgets, link, fleet.gateways, settings.workers)
        slots = SharedSlots(fleet.state.slots, link, budgets.share, settings.tenant_slots_ttl)
        link.run_while_open(slots.start, slots.stop)
    return TenantGate(settings, metrics, shared=budgets, slots=slots)
