"""A routed request: where the policy sent it, what the policy saw to decide, and the policy's
next choice should that backend fail before its first byte.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field, replace

from gateway.backends.pool import Backend, ModelPool
from gateway.prompt.parsing import RoutingInput
from gateway.routing.conversations import Turn
from gateway.routing.types import Decision, Policy, Route, RoutingState
from gateway.state.agreement import FleetView


@dataclass(slots=True, eq=False)
class Routed:
    """A request, where the policy sent it, and what the policy saw to decide."""

    request: RoutingInput
    chain: list[int]
    """The prompt's block hashes."""
    decision: Decision
    backend: Backend
    serving: ModelPool
    state: RoutingState
    sticky: str | None
    policy: Policy = field(repr=False)
    fleet: FleetView | None = None
    """What the fleet answered for it through Redis (None: nothing, or no fleet)."""
    claim_key: int | None = None
    """The key its shared prompt is claimed under (None: no shared prompt, or no claims)."""
    turn: Turn | None = None
    """The request's place in its conversation (chat, or any request with a session key)."""
    accepted_by: set[str] = field(default_factory=set)
    """Backends that accepted the request (answered 2xx): its prompt is theirs for good."""
    pinned: bool = False
    """Only `backend` can answer (it holds the response the request names): no failover."""
    answered: list[int] | None = None
    """The chain of prompt and answer, once `Router.answered` took it in (recorded for every
    gateway where it grew, before the client had the answer's last bytes)."""

    def accepted(self, backend: str) -> None:
        """`backend` answered 2xx: its prompt is there for good."""
        self.accepted_by.add(backend)

    @property
    def affinity_key(self) -> int:
        return self.state.affinity_key

    def fallback(self, tried: Collection[str]) -> tuple[Backend, Decision] | None:
        """The policy's next choice (route `retry`) among the backends not yet `tried`."""
        if self.pinned:
            return None
        left = [
            backend
            for backend in self.serving.backends
            if backend.name not in tried and backend.healthy and not backend.draining
        ]
        if not left:
            return None
        serving = ModelPool(left)
        state = replace(
            self.state,
            candidates=serving.names,
            members=serving.members,
            loads=serving.loads,
            total_load=serving.total_load,
            recent_total=None,
            pending_prefill=serving.pending_prefill,
            sticky=None,
        )
        choice = self.policy.choose(state)
        retry = Decision(choice.backend, Route.RETRY, choice.matched_blocks, choice.load_bound)
        return serving.by_name[choice.backend], retry
