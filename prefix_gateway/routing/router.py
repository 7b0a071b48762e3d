"""The router: decides where a request goes (`route`), and hands back the `Placement` that
the proxy holds from then on. What routing remembers is written by the `Recorder`; what it
counts, by the `RoutingObserver`; the policy only chooses. No HTTP here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from prefix_gateway.backends.backend import Backend, ModelPool
from prefix_gateway.backends.pool import BackendPool, Lease
from prefix_gateway.clock import Clock, monotonic
from prefix_gateway.config import Settings
from prefix_gateway.metrics import Metrics
from prefix_gateway.prompt.hashing import chain_hashes, chain_seed, key_hash
from prefix_gateway.prompt.parsing import Endpoint, RoutingInput
from prefix_gateway.prompt.tokens import EngineTokenizer
from prefix_gateway.refusals import model_not_found, refused
from prefix_gateway.routing.baselines import LeastLoadedInTurnPolicy
from prefix_gateway.routing.conversations import Turn, fingerprint
from prefix_gateway.routing.observer import RoutingObserver
from prefix_gateway.routing.placement import CONVERSATIONS, Placement
from prefix_gateway.routing.recorder import Recorder, Stores
from prefix_gateway.routing.ring import load_bound
from prefix_gateway.routing.stored_responses import not_found
from prefix_gateway.routing.traffic import cold_prompt
from prefix_gateway.routing.types import Decision, Policy, Route, RoutingState
from prefix_gateway.state.agreement import FleetView, SharedPrompt

Room = Callable[[Backend], bool]
"""Which backends may take a request now (flow control: those with a free slot)."""

# Every decision with a shared prompt and what it was shown, at DEBUG (loadtest/fleet_bench.py
# reads it to tell which input moved a prompt).
trace = logging.getLogger("prefix_gateway.routing.decisions")


class NoRoom(Exception):
    """No backend serving the request's model has room for it any more: it was given its turn
    while one had, and another request took that room first."""


_AFFINE = frozenset({Route.SESSION, Route.OWNER, Route.PREFIX})
"""Routes that follow what a backend holds: a request they choose is worth waiting for there."""


@dataclass(frozen=True, slots=True)
class Explanation:
    """What `Router.explain` found: the placement, what the policy was shown, the conversation."""

    placement: Placement
    turn: Turn


class AdapterPlacer(Protocol):
    """Where LoRA adapters declared to be loaded on demand are placed
    (`prefix_gateway.backends.adapters`)."""

    async def place(self, model: str, pick: Callable[[ModelPool], Backend]) -> None:
        """Load `model` where `pick` chooses, if it is a declared adapter no replica serves."""
        ...

    def sent(self, model: str, backend: str) -> None:
        """A request for `model` goes to `backend`."""
        ...


class Router:
    adapters: AdapterPlacer | None = None
    """Set where `lora_adapters` are declared."""

    def __init__(
        self,
        settings: Settings,
        pool: BackendPool,
        stores: Stores,
        policy: Policy,
        metrics: Metrics,
        tokenizer: EngineTokenizer | None = None,
        clock: Clock = monotonic,
    ) -> None:
        """`tokenizer`: the engine's (`--tokenizer`), which request parsing uses too."""
        self.pool = pool
        self.tokenizer = tokenizer
        self.policy = policy
        self.memory = Recorder(settings, pool, stores, metrics, tokenizer, clock)
        self._observer = RoutingObserver(metrics, settings)
        self._by_model = LeastLoadedInTurnPolicy()
        self._settings = settings
        self._block_chars = settings.block_chars
        self._block_tokens = settings.block_tokens
        self._max_blocks = settings.max_prompt_blocks
        self._affinity_chars = round(settings.affinity_tokens * settings.chars_per_token)
        self._chars_per_token = settings.chars_per_token
        self._routed = 0

    def placing(self, request: RoutingInput) -> Placing:
        """`request` on its way to its placement: the one routing object a request's life holds
        until it is placed."""
        return Placing(self, request)

    async def route(self, request: RoutingInput, room: Room | None = None) -> Placement:
        """Decide where `request` goes, record it there, and hand back its placement; with
        `room`, among the backends it admits. No slot is taken (`Placing.place` takes one)."""
        placing = Placing(self, request)
        await placing.place(room, slot=False)
        assert placing.placement is not None
        return placing.placement

    async def _holder_of(self, request: RoutingInput) -> Backend | None:
        """See `Placing.holder`."""
        named = request.response_id or request.previous_response_id
        if named is not None:
            return await self._stored_at(request, named)
        serving = self.pool.serving(request.model)
        if serving is None or not request.endpoint.by_prefix:
            return None
        decision = (await self.decide(request)).decision
        if decision.route not in _AFFINE or not decision.matched_blocks:
            return None
        return serving.by_name.get(decision.backend)

    async def _decided(self, placing: Placing, room: Room | None) -> Placement:
        """The placement of `placing`'s request, by the policy among the backends `room`
        admits (looked at again once decided: a decision that waited on Redis may find its
        backend taken meanwhile); `NoRoom` when none does."""
        request = placing.request
        if request.response_id or request.previous_response_id:
            holder = await placing.holder()
            assert holder is not None
            if room is not None and not room(holder):
                raise NoRoom
            return self._pinned(request, holder)
        adapters = self.adapters
        if adapters is not None and self.pool.serving(request.model) is None:
            await adapters.place(request.model, self._adapter_home)
        for _ in range(len(self.pool.backends) + 1):
            placement = await self.decide(request, count=True, room=room)
            if room is None or room(placement.backend):
                if adapters is not None:
                    adapters.sent(request.model, placement.backend.name)
                self._routed += 1
                return placement
        raise NoRoom

    async def _stored_at(self, request: RoutingInput, response_id: str) -> Backend:
        """The replica holding `response_id`: a 404 when no gateway saw it produced for this
        tenant (no replica is tried: one might hold another tenant's), or its replica is gone."""
        param = "response_id" if request.response_id is not None else "previous_response_id"
        holder = await self.memory.responses.holder(response_id, request.owner, param)
        if holder is None:
            raise not_found(response_id, param)
        return holder

    def _pinned(self, request: RoutingInput, holder: Backend) -> Placement:
        """`request` (naming a stored response) to the replica `holder` that holds it, whatever
        its load. The prompt it computes starts with the stored conversation, which the gateway
        never saw whole: nothing of it is indexed."""
        serving = ModelPool([holder])
        state = RoutingState(candidates=serving.names, loads=serving.loads)
        decision = Decision(holder.name, Route.PREVIOUS_RESPONSE)
        return Placement(request, [], decision, serving, state, self.policy, pinned=True)

    async def decide(
        self,
        request: RoutingInput,
        count: bool = False,
        room: Room | None = None,
    ) -> Placement:
        """The policy's placement for `request` now, not recorded. With `count` (`route`),
        the request is counted in its shared prompt's recent traffic, here and, in the same
        round trip as the look-ups, in the fleet's: the share the policy weighs includes it."""
        memory = self.memory
        serving = self.serving(request.model)
        if room is not None:
            serving = serving.having(room)
            if not serving.backends:
                raise NoRoom
        if not request.endpoint.by_prefix:
            state = RoutingState(
                candidates=serving.names, loads=serving.loads, sequence=self._routed
            )
            decision = self._by_model.choose(state)
            return Placement(request, [], decision, serving, state, self._by_model)
        hashed, block = request.hashed(self._block_chars, self._block_tokens)
        chain = chain_hashes(hashed, block, chain_seed(request.cache_salt), limit=self._max_blocks)
        private_from = request.distinct_from // self._block_chars
        if request.tokens is not None and request.canonical:
            # Where the first user message begins, in tokens, at the prompt's own ratio.
            share = request.distinct_from / len(request.canonical)
            private_from = int(share * len(hashed)) // block
        affinity_key = self._affinity_key(request)
        traffic = memory.traffic
        prompt_key = traffic.shared_prompt(chain, private_from)
        fleet_prompt = prompt_key if memory.count_prompts else None
        agreement = memory.agreement
        if prompt_key is None or request.endpoint is Endpoint.EMBEDDINGS:
            agreement = None
        sticky: str | None = None
        fleet: FleetView | None = None
        index = memory.index
        if request.session_key is None and agreement is None:
            matched = await index.match(request.model, chain)
        else:
            key = request.session_key
            session = memory.sessions.get(key) if key is not None else _nothing()
            consulted: Awaitable[FleetView | None] = (
                agreement.consult(request.model, chain[0], prompt_key, fleet_prompt, count)
                if agreement is not None and prompt_key is not None
                else _nothing()
            )
            # At once: with Redis they are round trips that need not wait in turn.
            matched, sticky, fleet = await asyncio.gather(
                index.match(request.model, chain), session, consulted
            )
        share = traffic.prompt_share(
            chain, private_from, count, fleet.prompt_count if fleet is not None else None
        )
        claimed = fleet.claimed if fleet is not None and memory.claims else None
        end = min(private_from, len(chain))
        if (
            claimed
            and matched.get(claimed, 0) < end
            and cold_prompt(share, len(serving.names), self._settings.load_factor)
        ):
            # Its claimant computes the shared prompt: as if indexed there (a hot one spreads).
            matched = {**matched, claimed: end}
        recent = traffic.recent
        state = RoutingState(
            candidates=serving.names,
            loads=serving.loads,
            hashes=chain,
            matched=matched,
            affinity_key=affinity_key,
            private_from=private_from,
            first_turn=request.first_turn,
            sticky=sticky,
            keyed=request.session_key is not None,
            recent=recent.view,
            members=serving.members,
            total_load=serving.total_load,
            recent_total=recent.sum_over(serving.members),
            shared_share=share,
            sequence=self._routed,
            pending_prefill=serving.pending_prefill,
            adapter_key=serving.adapter_key,
            prompt_tokens=round(request.estimated_tokens(self._chars_per_token)),
            first_token=memory.first_token,
        )
        decision = self.policy.choose(state)
        if prompt_key is not None and trace.isEnabledFor(logging.DEBUG):
            trace.debug(
                "decision %s",
                {
                    "t": time.time(),
                    "prompt": prompt_key,
                    "count": count,
                    "route": decision.route.value,
                    "backend": decision.backend,
                    "matched": matched,
                    "claimed": claimed,
                    "fleet": fleet is not None,
                    "share": round(share, 4),
                    "loads": {name: state.loads.get(name, 0) for name in serving.names},
                    "recent": {name: round(recent.get(name), 2) for name in serving.names},
                    "pending": dict(state.pending_prefill),
                    "bound": decision.load_bound,
                },
            )
        return Placement(
            request,
            chain,
            decision,
            serving,
            state,
            self.policy,
            sticky=sticky,
            fleet=fleet,
            shared=(
                SharedPrompt(request.model, chain[0], prompt_key, end)
                if agreement is not None and prompt_key is not None
                else None
            ),
        )

    def _adapter_home(self, hosts: ModelPool) -> Backend:
        """The replica of `hosts` the policy picks for an adapter none of them serves yet."""
        state = RoutingState(
            candidates=hosts.names,
            loads=hosts.loads,
            members=hosts.members,
            total_load=hosts.total_load,
            sequence=self._routed,
            pending_prefill=hosts.pending_prefill,
            adapter_key=hosts.adapter_key,
        )
        return hosts.by_name[self.policy.choose(state).backend]

    async def explain(self, request: RoutingInput) -> Explanation:
        """The placement `route` would make for `request` now, recording nothing."""
        previous = request.previous_response_id
        if previous is not None:
            placement = self._pinned(request, await self._stored_at(request, previous))
        else:
            placement = await self.decide(request)
        prompt = fingerprint(request.canonical) if request.endpoint in CONVERSATIONS else None
        return Explanation(placement, self.memory.conversations.peek(request.session_key, prompt))

    def load_bounds(self) -> dict[str, int]:
        """The bound a new request meets at each serving backend now (largest over its models)."""
        settings = self._settings
        bounds: dict[str, int] = {}
        for model in self.pool.served_models():
            serving = self.serving(model)
            bound = load_bound(
                serving.total_load, len(serving.names), settings.load_factor, settings.load_floor
            )
            for item in serving.backends:
                bounds[item.name] = max(bound, bounds.get(item.name, 0))
        return bounds

    def serving(self, model: str) -> ModelPool:
        serving = self.pool.serving(model)
        if serving is None:
            if not self.pool.might_serve(model):
                raise model_not_found(model)
            raise refused("no_healthy_backend", model)
        return serving

    def _affinity_key(self, request: RoutingInput) -> int:
        if request.session_key is not None:
            return key_hash(request.session_key)
        start = request.distinct_from
        key = key_hash(request.canonical[start : start + self._affinity_chars])
        return key if request.tenant is None else key ^ key_hash(request.tenant)


async def _nothing() -> None:
    return None


class Placing:
    """A request on its way to its placement. `holder` names the replica it should wait for,
    looked up once; `place` decides, takes that backend's slot (its count of requests in
    flight) and records the placement, once. `placement` is set from the moment a backend was
    chosen and its slot taken, so that whoever ends the request settles it even when
    recording it broke off."""

    __slots__ = ("_holder", "_looked_up", "_router", "placement", "request")

    def __init__(self, router: Router, request: RoutingInput) -> None:
        self._router = router
        self.request = request
        self.placement: Placement | None = None
        self._holder: Backend | None = None
        self._looked_up = False

    @property
    def pinned(self) -> bool:
        """It names a stored response: only the replica that holds it can answer."""
        request = self.request
        return request.response_id is not None or request.previous_response_id is not None

    async def holder(self) -> Backend | None:
        """The replica the request should wait for when every slot is taken: the one that
        stored the response it names (a 404 when none did), else the one its prefix or
        session would bring it to, by a preview that records nothing; None: any will do."""
        if not self._looked_up:
            self._holder = await self._router._holder_of(self.request)
            self._looked_up = True
        return self._holder

    async def place(self, room: Room | None = None, slot: bool = True) -> Placement:
        """Decide, among the backends `room` admits (`NoRoom` when none does now), take the
        chosen backend's slot (with `slot`), and record the placement."""
        router = self._router
        began = time.perf_counter()
        placement = await router._decided(self, room)
        if slot:
            placement.slot = Lease(placement.backend).take()
        self.placement = placement
        await placement.commit(router.memory, router._observer, time.perf_counter() - began)
        return placement
