"""The router: from a parsed request to a decision, and from a response back to the index.

It gathers what the policy needs (candidates, loads, index matches, the session's backend,
recent traffic), asks the policy, and records what was decided and what came back. It knows
no HTTP; the proxy calls it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from gateway.backends.pool import Backend, BackendPool, Candidates
from gateway.clock import Clock, monotonic
from gateway.config import Settings
from gateway.errors import NoHealthyBackend, NotFound
from gateway.metrics import Metrics
from gateway.prompt.hashing import chain_hashes, extend_hashes, key_hash
from gateway.prompt.parsing import Endpoint, RoutingInput, message_segment
from gateway.routing.conversations import (
    AffinityMiss,
    ConversationTracker,
    Turn,
    answer_hash,
    fingerprint,
    miss_cause,
)
from gateway.routing.policies import Decision, Policy, Route, RoutingState
from gateway.routing.ring import load_bound, within_bound
from gateway.routing.traffic import Traffic
from gateway.state.index import PrefixIndex
from gateway.state.sessions import SessionStore


@dataclass(slots=True)
class RoutedRequest:
    input: RoutingInput
    hashes: list[int]
    affinity_key: int
    decision: Decision
    backend: Backend
    tried: list[str] = field(default_factory=list)
    turn: Turn | None = None
    """The request's place in its conversation (chat, or any request with a session key)."""
    first_byte_at: float = 0.0
    """`time.perf_counter()` when the response's first byte came back."""
    prefilled: asyncio.Event | None = None
    """Set at the first byte, for requests waiting for this one's prefill."""
    issued_session: str | None = None
    """A session key the gateway minted for this request, sent back as a sticky cookie."""
    pending_prefill: int = 0
    """Blocks this request adds to its backend's pending prefill until its first byte."""

    @property
    def route(self) -> Route:
        return self.decision.route

    def reached_first_byte(self) -> None:
        self.first_byte_at = time.perf_counter()
        self.prefill_done()
        if self.prefilled is not None:
            self.prefilled.set()

    def prefill_starts(self, matched: Mapping[str, int]) -> None:
        """Count the blocks its backend has to compute for it (the prompt past its match)."""
        self.pending_prefill = max(0, len(self.hashes) - matched.get(self.backend.name, 0))
        self.backend.pending_prefill += self.pending_prefill

    def prefill_done(self) -> None:
        """Its prefill is over: the first byte came, or it ended or moved without one."""
        self.backend.pending_prefill -= self.pending_prefill
        self.pending_prefill = 0


@dataclass(frozen=True, slots=True)
class Answered:
    """What a response's answer adds (`Router.answered`)."""

    segment: bytes
    """The answer as the next turn's history carries it (empty when there is none)."""
    chain: list[int]
    """What the index holds for the request once the answer is recorded."""


@dataclass(frozen=True, slots=True)
class Explanation:
    """What `Router.explain` found: the decision and everything the policy was shown."""

    request: RoutingInput
    blocks: int
    affinity_key: int
    sticky: str | None
    loads: dict[str, int]
    """Load per candidate."""
    matched: dict[str, int]
    recent: dict[str, float]
    decision: Decision
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
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.index = index
        self.sessions = sessions
        self.policy = policy
        self.metrics = metrics
        self.traffic = Traffic(clock, settings)
        self.recent = self.traffic.recent
        self._routed = 0
        self.conversations = ConversationTracker(
            settings.affinity_ttl, settings.conversations_max, clock
        )
        self._block_chars = settings.block_chars
        self._affinity_chars = round(settings.affinity_tokens * settings.chars_per_token)
        self._decision_seconds = metrics.decision_seconds.labels(settings.policy)

    def affinity_key(self, request: RoutingInput) -> int:
        if request.session_key is not None:
            return key_hash(request.session_key)
        start = request.distinct_from
        return key_hash(request.canonical[start : start + self._affinity_chars])

    async def route(self, request: RoutingInput) -> RoutedRequest:
        began = time.perf_counter()
        group, hashes, affinity_key, matched, sticky = await self._gather(request)
        share = self.traffic.prompt_share(
            hashes, request.distinct_from // self._block_chars, count=True
        )
        decision = self.policy.choose(
            self.state(request, group, hashes, matched, affinity_key, sticky, share)
        )
        self._routed += 1
        backend = group.by_name[decision.backend]
        self._decision_seconds.observe(time.perf_counter() - began)
        if sticky is not None and sticky != backend.name:
            self.metrics.session_moves.labels(_move_cause(sticky, group, decision)).inc()
        routed = RoutedRequest(request, hashes, affinity_key, decision, backend, [backend.name])
        routed.prefill_starts(matched)
        try:
            routed.turn = self._follow(routed, group, matched)
            await self._record_choice(routed)
        except BaseException:
            # The proxy's `finally` takes the count back only for a request it got.
            routed.prefill_done()
            raise
        return routed

    async def explain(self, request: RoutingInput) -> Explanation:
        """The decision `route` would make for `request` now, recording nothing."""
        group, hashes, affinity_key, matched, sticky = await self._gather(request)
        share = self.traffic.prompt_share(
            hashes, request.distinct_from // self._block_chars, count=False
        )
        state = self.state(request, group, hashes, matched, affinity_key, sticky, share)
        decision = self.policy.choose(state)
        prompt = fingerprint(request.canonical) if request.endpoint is Endpoint.CHAT else None
        return Explanation(
            request,
            len(hashes),
            affinity_key,
            sticky,
            {item.name: item.load for item in group.backends},
            matched,
            self.recent.snapshot(group.names),
            decision,
            self.conversations.peek(request.session_key, prompt),
        )

    def load_bounds(self) -> dict[str, int]:
        """The bound a new request meets at each serving backend now (largest over its models)."""
        settings = self.settings
        bounds: dict[str, int] = {}
        for model in self.pool.served_models():
            group = self.candidates(model)
            bound = load_bound(
                group.total_load, len(group.names), settings.load_factor, settings.load_floor
            )
            for item in group.backends:
                bounds[item.name] = max(bound, bounds.get(item.name, 0))
        return bounds

    async def reroute(self, routed: RoutedRequest) -> bool:
        """Move a request that failed before its first byte to the next candidate."""
        untried = [
            item
            for item in self.candidates(routed.input.model).backends
            if item.name not in routed.tried
        ]
        if not untried:
            return False
        group = Candidates(untried)
        matched = await self.index.match(routed.input.model, routed.hashes)
        choice = self.policy.choose(
            self.state(routed.input, group, routed.hashes, matched, routed.affinity_key)
        )
        routed.decision = Decision(
            choice.backend, Route.RETRY, choice.matched_blocks, choice.load_bound
        )
        routed.prefill_done()
        routed.backend = group.by_name[choice.backend]
        routed.prefill_starts(matched)
        routed.tried.append(choice.backend)
        if routed.input.session_key is not None:
            self.metrics.session_moves.labels("failover").inc()
        await self._record_choice(routed)
        return True

    def answered(self, routed: RoutedRequest, answer: str) -> Answered:
        """The answer as the next turn's history carries it, and the chain of the prompt and
        that answer, which a chat's next turn extends (the prompt's own chain otherwise)."""
        segment = message_segment("assistant", answer) if answer else b""
        if routed.input.endpoint is not Endpoint.CHAT or not answer:
            return Answered(segment, routed.hashes)
        history = routed.input.canonical + segment
        chain = extend_hashes(routed.hashes, history, self._block_chars)
        # An answer too short to complete a block adds nothing the routing did not record.
        return Answered(segment, chain if len(chain) > len(routed.hashes) else routed.hashes)

    async def learn_answer(self, routed: RoutedRequest, answered: Answered) -> None:
        """The answer joins the conversation's history: index its chain on the backend that
        wrote it."""
        self._settle(routed, answered.segment)
        if answered.chain is not routed.hashes:
            await self.index.record(routed.input.model, routed.backend.name, answered.chain)

    async def _gather(
        self, request: RoutingInput
    ) -> tuple[Candidates, list[int], int, dict[str, int], str | None]:
        candidates = self.candidates(request.model)
        hashes = chain_hashes(request.canonical, self._block_chars)
        affinity_key = self.affinity_key(request)
        if request.session_key is None:
            matched = await self.index.match(request.model, hashes)
            return candidates, hashes, affinity_key, matched, None
        # Both at once: with Redis they are two round trips that need not wait for each other.
        matched, sticky = await asyncio.gather(
            self.index.match(request.model, hashes), self.sessions.get(request.session_key)
        )
        return candidates, hashes, affinity_key, matched, sticky

    def _follow(
        self, routed: RoutedRequest, candidates: Candidates, matched: dict[str, int]
    ) -> Turn | None:
        """Place the request in its conversation; count a cache break when it has one."""
        request = routed.input
        is_chat = request.endpoint is Endpoint.CHAT
        if not is_chat and request.session_key is None:
            return None
        prompt = fingerprint(request.canonical) if is_chat else None
        chosen = routed.backend.name
        turn = self.conversations.follow(request.session_key, prompt, chosen)
        if turn.cause is not None:
            self.metrics.child(self.metrics.cache_breaks, request.model, turn.cause.value).inc()
        previous = turn.previous_backend
        if turn.continues and previous is not None and previous != chosen:
            turn.miss = miss_cause(
                previous, candidates.loads, routed.decision.load_bound, matched, chosen
            )
        return turn

    def _settle(self, routed: RoutedRequest, answer_segment: bytes) -> None:
        """Once answered: count failover and affinity, remember who answered and what."""
        model = routed.input.model
        served = routed.backend.name
        if len(routed.tried) > 1:
            self.metrics.child(self.metrics.failovers, model).inc()
        turn = routed.turn
        if turn is None:
            return
        turn.record.backend = served
        if answer_segment:
            turn.record.answer = answer_hash(answer_segment)
        if not turn.continues:
            return
        if turn.previous_backend == served:
            self.metrics.child(self.metrics.affinity_hits, model).inc()
            return
        miss = turn.miss or AffinityMiss.SPREAD
        if turn.previous_backend in routed.tried:
            miss = AffinityMiss.FAILOVER
        self.metrics.child(self.metrics.affinity_misses, model, miss.value).inc()

    def candidates(self, model: str) -> Candidates:
        candidates = self.pool.group(model)
        if candidates is None:
            if not self.pool.knows_model(model):
                raise NotFound(
                    f"The model `{model}` does not exist.", param="model", code="model_not_found"
                )
            raise NoHealthyBackend(
                f"no healthy backend serves model `{model}`", code="no_healthy_backend"
            )
        return candidates

    def state(
        self,
        request: RoutingInput,
        candidates: Candidates,
        hashes: list[int],
        matched: dict[str, int],
        affinity_key: int,
        sticky: str | None = None,
        shared_share: float = 0.0,
    ) -> RoutingState:
        """What the policy is shown: views of live load and traffic, nothing copied per backend."""
        members = candidates.members
        return RoutingState(
            candidates=candidates.names,
            loads=candidates.loads,
            hashes=hashes,
            matched=matched,
            affinity_key=affinity_key,
            private_from=request.distinct_from // self._block_chars,
            sticky=sticky,
            keyed=request.session_key is not None,
            recent=self.recent.view,
            members=members,
            total_load=candidates.total_load,
            recent_total=self.recent.sum_over(members),
            shared_share=shared_share,
            sequence=self._routed,
            pending_prefill=candidates.pending_prefill,
        )

    async def _record_choice(self, routed: RoutedRequest) -> None:
        request = routed.input
        name = routed.backend.name
        self.recent.add(name)
        if request.endpoint is not Endpoint.EMBEDDINGS:
            await self.index.record(request.model, name, routed.hashes)
        if request.session_key is not None:
            await self.sessions.put(request.session_key, name)
        if routed.decision.route is Route.OVERFLOW:
            self.metrics.child(self.metrics.overflows, request.model).inc()


def _move_cause(sticky: str, candidates: Candidates, decision: Decision) -> str:
    """Why a session left its backend: gone from the candidates, over the bound, or the policy."""
    backend = candidates.by_name.get(sticky)
    if backend is None:
        return "unhealthy"
    if decision.load_bound > 0 and not within_bound(backend.load, decision.load_bound):
        return "load_bound"
    return "policy"
