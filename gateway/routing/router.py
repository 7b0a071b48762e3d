"""The router: decides once where a request goes (`route`), and learns once from what came
back (`learn`). The choice is recorded before the request leaves, so the next request sharing
its prefix follows it. No HTTP here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass

from gateway.backends.pool import Backend, BackendPool, ModelPool
from gateway.clock import Clock, monotonic
from gateway.config import Settings
from gateway.errors import NoHealthyBackend, NotFound
from gateway.metrics import Metrics
from gateway.prompt.canonical import message_segment
from gateway.prompt.hashing import chain_hashes, extend_hashes, key_hash
from gateway.prompt.parsing import Endpoint, RoutingInput
from gateway.prompt.tokens import TOKEN_BYTES, EngineTokenizer
from gateway.routing.affinity import (
    CONVERSATIONS,
    count_reported,
    follow_turn,
    move_cause,
    settle_turn,
)
from gateway.routing.baselines import LeastLoadedInTurnPolicy
from gateway.routing.conversations import (
    ConversationTracker,
    Turn,
    fingerprint,
)
from gateway.routing.feedback import CacheFeedback
from gateway.routing.responses import ResponseHolders, not_found
from gateway.routing.ring import load_bound
from gateway.routing.routed import Routed
from gateway.routing.traffic import Traffic
from gateway.routing.types import Decision, Outcome, Policy, Route, RoutingState
from gateway.state.agreement import Agreement, FleetView
from gateway.state.engine_blocks import EventFedIndex
from gateway.state.index import PrefixIndex
from gateway.state.sessions import InMemorySessionStore, SessionStore

log = logging.getLogger("gateway.routing")


@dataclass(frozen=True, slots=True)
class Explanation:
    """What `Router.explain` found: the decision, what the policy was shown, the conversation."""

    routed: Routed
    turn: Turn


class Router:
    def __init__(
        self,
        settings: Settings,
        pool: BackendPool,
        index: PrefixIndex,
        sessions: SessionStore,
        policy: Policy,
        metrics: Metrics,
        clock: Clock = monotonic,
        responses: SessionStore | None = None,
        tokenizer: EngineTokenizer | None = None,
        engine_index: EventFedIndex | None = None,
        agreement: Agreement | None = None,
        fleet_share: frozenset[str] = frozenset({"claims", "prompts"}),
    ) -> None:
        """`responses`: where the replica of each stored response is kept (by default in
        memory, like sessions)."""
        self.pool = pool
        self.tokenizer = tokenizer
        """The engine's tokenizer (`--tokenizer`), which request parsing uses too."""
        self._engine_index = engine_index
        """The index fed by the replicas' KV events (`--kv-events`), when `index` is it."""
        self.index = index
        self.sessions = sessions
        self._claims = "claims" in fleet_share
        self._count_prompts = "prompts" in fleet_share
        self.agreement = agreement if self._claims or self._count_prompts else None
        self.policy = policy
        if responses is None:
            responses = InMemorySessionStore(settings.affinity_ttl, settings.session_max, clock)
        self.responses = ResponseHolders(pool, responses)
        self._by_model = LeastLoadedInTurnPolicy()
        self.metrics = metrics
        self.traffic = Traffic(clock, settings)
        self.conversations = ConversationTracker(
            settings.affinity_ttl, settings.conversations_max, clock
        )
        self.feedback = CacheFeedback(index, metrics, settings) if settings.cache_feedback else None
        self._settings = settings
        self._block_chars = settings.block_chars
        self._block_tokens = settings.block_tokens
        self._max_blocks = settings.max_prompt_blocks
        self._affinity_chars = round(settings.affinity_tokens * settings.chars_per_token)
        self._decision_seconds = metrics.decision_seconds.labels(settings.policy)
        self._routed = 0

    async def route(self, request: RoutingInput) -> Routed:
        """Decide where `request` goes and record it there."""
        began = time.perf_counter()
        if request.previous_response_id is not None:
            routed = await self.route_to_holder(
                request, request.previous_response_id, "previous_response_id"
            )
            self._decision_seconds.observe(time.perf_counter() - began)
            return routed
        routed = await self.decide(request, count=True)
        self._decision_seconds.observe(time.perf_counter() - began)
        self._routed += 1
        sticky, backend = routed.sticky, routed.backend.name
        if sticky is not None and sticky != backend:
            cause = move_cause(sticky, routed.serving, routed.decision)
            self.metrics.session_moves.labels(cause).inc()
        if routed.decision.route is Route.OVERFLOW:
            self.metrics.child(self.metrics.overflows, request.model).inc()
        routed.turn = follow_turn(self.conversations, self.metrics, routed)
        self.traffic.recent.add(backend)
        await self._record(request, backend, routed.chain)
        fleet, claim_key = routed.fleet, routed.claim_key
        if (
            fleet is not None
            and fleet.claimed is None
            and claim_key is not None
            and routed.decision.matched_blocks < _shared_end(routed.state)
            and self._cold(routed.state.shared_share, routed.serving)
        ):
            # This backend computes the shared prompt now: the other gateways count it as
            # held there until the index says so (it is shared once the replica accepts it).
            assert self.agreement is not None
            self.agreement.claim(request.model, routed.chain[0], claim_key, backend)
        return routed

    async def route_to_holder(
        self, request: RoutingInput, response_id: str, param: str = "response_id"
    ) -> Routed:
        """`request` (naming a stored response in `param`) to the replica holding
        `response_id`; a 404 when no gateway saw it produced for this tenant (no replica is
        tried: one might hold another tenant's), or its replica is gone."""
        holder = await self.responses.holder(response_id, request.tenant, param)
        if holder is None:
            raise not_found(response_id, param)
        return self.pinned(request, holder)

    def pinned(self, request: RoutingInput, backend: Backend) -> Routed:
        """`request` to `backend` whatever its load: it holds what the request names. The
        prompt it computes starts with the stored conversation, which the gateway never saw
        whole: nothing of it is recorded in the index."""
        serving = ModelPool([backend])
        state = RoutingState(candidates=serving.names, loads=serving.loads)
        decision = Decision(backend.name, Route.PREVIOUS_RESPONSE)
        return Routed(
            request,
            [],
            decision,
            backend,
            serving,
            state,
            None,
            self.policy,
            pinned=True,
        )

    async def decide(self, request: RoutingInput, count: bool = False) -> Routed:
        """The policy's decision for `request` now; with `count` it counts in its shared
        prompt's traffic (routed, not explained). Records nothing else."""
        serving = self.serving(request.model)
        if not request.endpoint.by_prefix:
            return self._least_loaded(request, serving)
        hashed, block = request.hashed(self._block_chars, self._block_tokens)
        chain = chain_hashes(hashed, block, _seed(request), limit=self._max_blocks)
        private_from = request.distinct_from // self._block_chars
        if request.tokens is not None and request.canonical:
            # Where the first user message begins, in tokens, at the prompt's own ratio.
            share = request.distinct_from / len(request.canonical)
            private_from = int(share * len(hashed)) // block
        affinity_key = self._affinity_key(request)
        prompt_key = self.traffic.shared_prompt(chain, private_from)
        claim_key = prompt_key if self._claims else None
        fleet_prompt = prompt_key if self._count_prompts else None
        agreement = self.agreement
        if prompt_key is None or request.endpoint is Endpoint.EMBEDDINGS:
            agreement = None
        sticky: str | None = None
        fleet: FleetView | None = None
        if request.session_key is None and agreement is None:
            matched = await self.index.match(request.model, chain)
        else:
            key = request.session_key
            session = self.sessions.get(key) if key is not None else _nothing()
            consulted: Awaitable[FleetView | None] = (
                agreement.consult(request.model, chain[0], prompt_key, fleet_prompt, count)
                if agreement is not None and prompt_key is not None
                else _nothing()
            )
            # At once: with Redis they are round trips that need not wait in turn.
            matched, sticky, fleet = await asyncio.gather(
                self.index.match(request.model, chain), session, consulted
            )
        share = self.traffic.prompt_share(
            chain, private_from, count, fleet.prompt_count if fleet is not None else None
        )
        claimed = fleet.claimed if fleet is not None and self._claims else None
        end = min(private_from, len(chain))
        if claimed and matched.get(claimed, 0) < end and self._cold(share, serving):
            # Its claimant computes the shared prompt: as if indexed there (a hot one spreads).
            matched = {**matched, claimed: end}
        recent = self.traffic.recent
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
        )
        decision = self.policy.choose(state)
        backend = serving.by_name[decision.backend]
        return Routed(
            request,
            chain,
            decision,
            backend,
            serving,
            state,
            sticky,
            self.policy,
            fleet,
            claim_key,
        )

    def _least_loaded(self, request: RoutingInput, serving: ModelPool) -> Routed:
        state = RoutingState(candidates=serving.names, loads=serving.loads, sequence=self._routed)
        decision = self._by_model.choose(state)
        backend = serving.by_name[decision.backend]
        return Routed(
            request, [], decision, backend, serving, state, None, self._by_model
        )

    async def explain(self, request: RoutingInput) -> Explanation:
        """The decision `route` would make for `request` now, recording nothing."""
        previous = request.previous_response_id
        if previous is not None:
            routed = await self.route_to_holder(request, previous, "previous_response_id")
        else:
            routed = await self.decide(request)
        prompt = fingerprint(request.canonical) if request.endpoint in CONVERSATIONS else None
        return Explanation(routed, self.conversations.peek(request.session_key, prompt))

    async def learn(self, routed: Routed, outcome: Outcome) -> None:
        """Take in what came back: failover, the answer's blocks, cached tokens, affinity."""
        request = routed.request
        if routed.pinned or not request.endpoint.by_prefix:
            count_reported(self.metrics, outcome, request.model)
            if len(outcome.tried) > 1:
                self.metrics.child(self.metrics.failovers, request.model).inc()
            return
        served = outcome.decision.backend
        first = routed.backend.name
        if first not in routed.accepted_by and request.endpoint is not Endpoint.EMBEDDINGS:
            # Recorded when routed, never accepted there: what it added is not there.
            matched = routed.state.matched.get(first, 0)
            await self.index.forget(request.model, first, routed.chain[matched:])
        if served != first:
            # Failed over: the prompt is where it was answered now.
            if request.session_key is not None:
                self.metrics.session_moves.labels("failover").inc()
            self.traffic.recent.add(served)
            await self._record(request, served, routed.chain)
        if outcome.status != 200:
            return
        model = request.model
        metrics = self.metrics
        settings = self._settings
        metrics.child(metrics.prompt_tokens_estimated, model).inc(
            request.estimated_tokens(settings.chars_per_token)
        )
        metrics.child(metrics.matched_tokens_predicted, model).inc(
            outcome.decision.matched_blocks * settings.block_tokens
        )
        count_reported(self.metrics, outcome, model)
        segment = message_segment("assistant", outcome.answer) if outcome.answer else b""
        chain = routed.answered
        taken_in = chain is not None
        if chain is None:
            chain = self._with_answer(routed, outcome.answer, outcome.completion_tokens)
        if self.feedback is not None:
            await self.feedback.observe(request, routed.chain, outcome, chain)
        settle_turn(self.metrics, routed, outcome, segment)
        if chain is not routed.chain and not taken_in:
            await self.index.record(model, served, chain)
            self.index.share(model, served, chain)
        if self._engine_index is not None:
            # The request is over: what the replica stored of it, its events have told.
            self._engine_index.settle(served, chain)

    def hears_answer(self, routed: Routed) -> bool:
        """Whether `answered` is to hear of `routed`'s answer: a conversation's, whose next
        turn extends it."""
        return not routed.pinned and routed.request.endpoint in CONVERSATIONS

    async def answered(
        self, routed: Routed, backend: str, answer: str, completion_tokens: int | None
    ) -> None:
        """`backend` answered `routed` in full; its client does not have the last bytes yet.
        The prompt and answer are recorded there for every gateway now: the conversation's
        next turn, sent the moment the client has the answer and perhaps to another gateway,
        must find them (recorded after the reply, they would lose that race). Never raises:
        the answer is the client's whatever becomes of recording it (`learn` tries again)."""
        try:
            chain = self._with_answer(routed, answer, completion_tokens)
            if chain is not routed.chain:
                await self.index.publish(routed.request.model, backend, chain)
            routed.answered = chain  # `learn` neither encodes the answer again nor records it
        except Exception:
            log.warning("recording an answer before its last bytes failed", exc_info=True)

    def _cold(self, share: float, serving: ModelPool) -> bool:
        """A shared prompt the owner rule keeps in one place: at most c / n of recent requests."""
        return share <= self._settings.load_factor / max(1, len(serving.names))

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
            if not self.pool.knows_model(model):
                raise NotFound(
                    f"The model `{model}` does not exist.", param="model", code="model_not_found"
                )
            raise NoHealthyBackend(
                f"no healthy backend serves model `{model}`", code="no_healthy_backend"
            )
        return serving

    def _affinity_key(self, request: RoutingInput) -> int:
        if request.session_key is not None:
            return key_hash(request.session_key)
        start = request.distinct_from
        key = key_hash(request.canonical[start : start + self._affinity_chars])
        return key if request.tenant is None else key ^ key_hash(request.tenant)

    async def _record(self, request: RoutingInput, backend: str, chain: list[int]) -> None:
        if not request.endpoint.by_prefix:
            return
        if request.endpoint is not Endpoint.EMBEDDINGS:
            await self.index.record(request.model, backend, chain)
            # Other gateways hear of it now, not once it is accepted a prefill later: the next
            # request sharing the prefix then follows it wherever it arrives. If the backend
            # never accepts it, `learn` forgets it there again.
            self.index.share(request.model, backend, chain)
        if request.session_key is not None:
            await self.sessions.put(request.session_key, backend)

    def _with_answer(
        self, routed: Routed, answer: str, completion_tokens: int | None
    ) -> list[int]:
        """The chain of the prompt and its answer, which a chat's next turn extends."""
        if routed.request.endpoint not in CONVERSATIONS or not answer:
            return routed.chain
        request = routed.request
        hashed, block = request.hashed(self._block_chars, self._block_tokens)
        if request.tokens is not None and self.tokenizer is not None:
            ids = self.tokenizer.text(answer, add_special_tokens=False)
            if completion_tokens is not None and len(ids) != completion_tokens * TOKEN_BYTES:
                # The engine cached the ids it generated, which this text does not encode back
                # to (it encodes to as many, as a rule, when they are the same).
                return routed.chain
            history = hashed + ids
        else:
            history = hashed + message_segment("assistant", answer)
        chain = extend_hashes(routed.chain, history, block, _seed(request), self._max_blocks)
        # An answer too short to complete a block adds nothing routing did not record.
        return chain if len(chain) > len(routed.chain) else routed.chain


async def _nothing() -> None:
    return None


def _shared_end(state: RoutingState) -> int:
    """The block where the request's shared prompt ends."""
    return min(state.private_from, len(state.hashes))


def _seed(request: RoutingInput) -> int:
    """Where a request's chain starts: as in the engine, a salted prompt (a tenant's, or a
    client's own `cache_salt`) shares no block with the same prompt under another salt."""
    return 0 if request.cache_salt is None else key_hash(request.cache_salt)
