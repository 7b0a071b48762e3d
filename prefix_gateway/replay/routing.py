"""Routing in a replay: the gateway's own policy, index and recent-traffic counter, shown what
`prefix_gateway.routing.router.Router` shows it for an HTTP request (no sessions: nothing is
sticky).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from prefix_gateway.clock import Clock
from prefix_gateway.config import Settings
from prefix_gateway.prompt.hashing import key_hash
from prefix_gateway.replay.traces import TraceRequest
from prefix_gateway.routing.policies import Decision, Policy, RoutingState
from prefix_gateway.routing.traffic import Traffic
from prefix_gateway.state.index import PrefixIndex

MODEL = "replay"


class ReplayRouter(Protocol):
    async def route(self, request: TraceRequest, loads: Mapping[str, int]) -> Decision:
        """Choose a replica for `request` arriving now, given the loads before it."""
        ...

    def prefilled(self, request: TraceRequest, decision: Decision) -> None:
        """The prefill of `request`, placed by `decision`, is over: its first token is out."""
        ...

    async def answered(self, request: TraceRequest, backend: str) -> None:
        """`backend` completed `request`."""
        ...


class PolicyRouter:
    def __init__(
        self,
        names: Sequence[str],
        policy: Policy,
        index: PrefixIndex,
        clock: Clock,
        settings: Settings,
    ) -> None:
        self._names = list(names)
        self._policy = policy
        self._index = index
        self._traffic = Traffic(clock, settings)
        self._routed = 0
        self._pending = dict.fromkeys(self._names, 0)

    async def route(self, request: TraceRequest, loads: Mapping[str, int]) -> Decision:
        names = self._names
        model = request.adapter or MODEL
        matched = await self._index.match(model, request.hashes)
        state = RoutingState(
            candidates=names,
            loads=loads,
            hashes=request.hashes,
            matched=matched,
            affinity_key=request.affinity_key,
            private_from=request.private_from,
            first_turn=request.first_turn,
            recent=self._traffic.recent.snapshot(names),
            shared_share=self._traffic.prompt_share(
                request.hashes, request.private_from, count=True
            ),
            sequence=self._routed,
            pending_prefill=self._pending,  # read during `choose` only, changed after it
            adapter_key=key_hash(request.adapter) if request.adapter else None,
        )
        decision = self._policy.choose(state)
        self._routed += 1
        self._pending[decision.backend] += _unmatched(request, decision)
        self._traffic.recent.add(decision.backend)
        await self._index.record(model, decision.backend, request.hashes)
        return decision

    def prefilled(self, request: TraceRequest, decision: Decision) -> None:
        self._pending[decision.backend] -= _unmatched(request, decision)

    async def answered(self, request: TraceRequest, backend: str) -> None:
        if request.answered:
            await self._index.record(request.adapter or MODEL, backend, request.answered)


def _unmatched(request: TraceRequest, decision: Decision) -> int:
    """The prompt blocks the index did not see on the chosen replica: its estimated prefill."""
    return max(0, len(request.hashes) - decision.matched_blocks)
