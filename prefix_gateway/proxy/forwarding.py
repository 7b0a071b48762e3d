"""One request on its way to the replicas: what the handler hands the forwarder, and what the
forwarder and the relay share of it. Its placement is the only routing object on the way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from prefix_gateway.proxy.deadlines import Exchange
from prefix_gateway.proxy.reply import Headers, Reply
from prefix_gateway.proxy.usage import Observation
from prefix_gateway.routing.placement import Placement
from prefix_gateway.routing.types import Decision, Outcome

_NOTHING_SEEN = Observation()
"""What a forwarding saw when no response was relayed (never written to)."""

GatewayHeaders = Callable[[Decision], Headers]
"""The gateway's own response headers for the attempt that answers."""


@dataclass(slots=True, eq=False)
class Forwarding:
    placement: Placement
    body: bytes
    """What the replica is sent, byte for byte."""
    headers: Headers
    """The request headers as a replica gets them."""
    exchange: Exchange
    reply: Reply
    gateway_headers: GatewayHeaders
    method: bytes
    path: str
    """The replica's path, with the query of a stored response's request."""
    strip_usage: bool = False
    """The stream's usage was asked for by the gateway, not the client: it is held back."""
    tenant_priority: int = 0
    """The priority of the request's tenant (higher is served first; anonymous: 0)."""
    own_priority: int | None = None
    """The engine priority its client asked for in vLLM's terms, where its tenant may set
    its own (`priority_range`): sent in place of any other."""
    needs_usage: bool = False
    """Its tenant's token budget is charged what it used: a stream asks for its usage."""
    counts_tokens: bool = False
    """What it used is charged or counted as service: the tokens a stream relays are counted."""
    seen: Observation | None = None
    """What the response relayed to the client carried, as far as it went (kept here, so that
    an answer the client cut short still says how far it got)."""
    decision: Decision = field(init=False)
    """The decision of the latest attempt (the placement's, or a retry's)."""
    tried: list[str] = field(default_factory=list)
    """Every backend tried, in order."""
    accepted: list[str] = field(default_factory=list)
    """The backends tried that accepted the request (answered 2xx)."""
    first_byte_at: float = 0.0

    def __post_init__(self) -> None:
        self.decision = self.placement.decision

    def outcome(self, status: int) -> Outcome:
        """What came of it, as far as it went: `status` is what the client was told."""
        seen = self.seen or _NOTHING_SEEN
        return Outcome(
            status,
            self.decision,
            tuple(self.tried) or (self.placement.backend.name,),
            seen.prompt_tokens,
            seen.cached_tokens,
            seen.answer,
            seen.sent_at,
            self.first_byte_at,
            seen.completion_tokens,
            tuple(self.accepted),
            seen.answered,
            seen.relayed_tokens,
        )
