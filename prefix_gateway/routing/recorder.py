"""What routing remembers, and the one place that writes it: the prefix index, sessions,
stored responses' replicas, conversations, recent traffic and the fleet's claims. A placement
is recorded when it is made (`placed`), a conversation's answer before its client has the
last bytes (`answer_complete`), and the outcome once the request is over (`settled`). No
metrics here (`prefix_gateway.routing.observer` counts); no HTTP.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from prefix_gateway.backends.pool import BackendPool
from prefix_gateway.clock import Clock
from prefix_gateway.config import Settings
from prefix_gateway.metrics import Metrics
from prefix_gateway.prompt.canonical import FIELD_TEXT, message_segment
from prefix_gateway.prompt.hashing import chain_seed, extend_hashes
from prefix_gateway.prompt.parsing import Endpoint, RoutingInput
from prefix_gateway.prompt.tokens import TOKEN_BYTES, EngineTokenizer
from prefix_gateway.routing.conversations import (
    ConversationTracker,
    Turn,
    answer_hash,
    fingerprint,
    miss_cause,
)
from prefix_gateway.routing.feedback import CacheFeedback
from prefix_gateway.routing.first_token import FirstTokenModel
from prefix_gateway.routing.placement import CONVERSATIONS, Placement
from prefix_gateway.routing.stored_responses import ResponseHolders
from prefix_gateway.routing.traffic import Traffic, cold_prompt
from prefix_gateway.routing.types import Outcome
from prefix_gateway.state.agreement import Agreement
from prefix_gateway.state.engine_blocks import EventFedIndex
from prefix_gateway.state.index import PrefixIndex
from prefix_gateway.state.sessions import InMemorySessionStore, SessionStore

log = logging.getLogger("prefix_gateway.routing")


@dataclass(frozen=True, slots=True)
class Stores:
    """The stores routing remembers in, as the composition root built them."""

    index: PrefixIndex
    sessions: SessionStore
    responses: SessionStore | None = None
    """Where the replica of each stored response is kept (None: in memory, like sessions)."""
    agreement: Agreement | None = None
    """What a fleet of gateways agrees on through Redis besides the index."""
    engine_index: EventFedIndex | None = None
    """The index fed by the replicas' KV events (`--kv-events`), when `index` is it."""


class Recorder:
    def __init__(
        self,
        settings: Settings,
        pool: BackendPool,
        stores: Stores,
        metrics: Metrics,
        tokenizer: EngineTokenizer | None,
        clock: Clock,
    ) -> None:
        share = settings.fleet_share
        self._claims = "claims" in share
        self.count_prompts = "prompts" in share
        self.index = stores.index
        self.sessions = stores.sessions
        consulted = self._claims or self.count_prompts or "prefills" in share
        self.agreement = stores.agreement if consulted else None
        responses = stores.responses
        if responses is None:
            responses = InMemorySessionStore(settings.affinity_ttl, settings.session_max, clock)
        self.responses = ResponseHolders(pool, responses)
        self.traffic = Traffic(clock, settings)
        self.conversations = ConversationTracker(
            settings.affinity_ttl, settings.conversations_max, clock
        )
        self.feedback = (
            CacheFeedback(stores.index, metrics, settings) if settings.cache_feedback else None
        )
        self.first_token = (
            FirstTokenModel(settings.ttft_half_life, clock, settings.ttft_margin)
            if settings.ttft_routing and settings.policy == "prefix"
            else None
        )
        self._chars_per_token = settings.chars_per_token
        self._engine_index = stores.engine_index
        self._tokenizer = tokenizer
        self._load_factor = settings.load_factor
        self._block_chars = settings.block_chars
        self._block_tokens = settings.block_tokens
        self._max_blocks = settings.max_prompt_blocks

    @property
    def claims(self) -> bool:
        """Whether a cold shared prompt is claimed for the fleet where it is computed first."""
        return self._claims and self.agreement is not None

    async def placed(self, placement: Placement) -> Turn | None:
        """Record where `placement` sends its request; its place in its conversation."""
        if placement.pinned:
            # It computes the stored conversation, which the gateway never saw whole.
            return None
        request = placement.request
        backend = placement.backend.name
        turn = self._follow(placement)
        self.traffic.recent.add(backend)
        await self._record(request, backend, placement.chain)
        fleet, shared, state = placement.fleet, placement.shared, placement.state
        if (
            self.claims
            and fleet is not None
            and fleet.claimed is None
            and shared is not None
            and placement.decision.matched_blocks < min(state.private_from, len(state.hashes))
            and cold_prompt(state.shared_share, len(placement.serving.names), self._load_factor)
        ):
            # This backend computes the shared prompt now: the other gateways count it as
            # held there until the index says so (it is shared once the replica accepts it).
            assert self.agreement is not None
            self.agreement.claim(shared.model, shared.first_block, shared.key, backend)
        return turn

    async def response_stored(self, response_id: str, owner: str | None, backend: str) -> None:
        await self.responses.remember(response_id, owner, backend)

    async def answer_complete(
        self, placement: Placement, backend: str, answer: str, completion_tokens: int | None
    ) -> list[int] | None:
        """Record `placement`'s prompt and answer at `backend` for every gateway now: the
        conversation's next turn, sent the moment the client has the answer and perhaps to
        another gateway, must find them (recorded after the reply, they would lose that race).
        The chain recorded, or None when recording failed (`settled` tries again)."""
        try:
            chain = self._with_answer(placement, answer, completion_tokens)
            if chain is not placement.chain:
                await self.index.publish(placement.request.model, backend, chain)
            return chain
        except Exception:
            log.warning("recording an answer before its last bytes failed", exc_info=True)
            return None

    async def settled(self, placement: Placement, outcome: Outcome) -> None:
        """Take in what came back: failover, the answer's blocks, cached tokens, the turn."""
        request = placement.request
        if placement.pinned or not request.endpoint.by_prefix:
            return
        if self.first_token is not None:
            self._timed(placement, outcome, self.first_token)
        model = request.model
        served = outcome.decision.backend
        first = placement.backend.name
        if first not in outcome.accepted and request.endpoint is not Endpoint.EMBEDDINGS:
            # Recorded when routed, never accepted there: what it added is not there.
            matched = placement.state.matched.get(first, 0)
            await self.index.forget(model, first, placement.chain[matched:])
        key, previous = request.session_key, placement.sticky
        if not outcome.accepted and key is not None and previous is not None and previous != first:
            # No backend took it: its session stays where its last answer came from.
            await self.sessions.put(key, previous)
        if served != first:
            # Failed over: the prompt is where it was answered now.
            self.traffic.recent.add(served)
            await self._record(request, served, placement.chain)
        if outcome.status != 200:
            return
        chain = placement.answered_chain
        taken_in = chain is not None
        if chain is None:
            chain = self._with_answer(placement, outcome.answer, outcome.completion_tokens)
        if self.feedback is not None:
            await self.feedback.observe(request, placement.chain, outcome, chain)
        turn = placement.turn
        if turn is not None:
            turn.record.backend = served
            if outcome.answer:
                turn.record.answer = answer_hash(message_segment("assistant", outcome.answer))
        if chain is not placement.chain and not taken_in:
            await self.index.record(model, served, chain)
            self.index.share(model, served, chain)
        if self._engine_index is not None:
            # The request is over: what the replica stored of it, its events have told.
            self._engine_index.settle(served, chain)

    def _timed(self, placement: Placement, outcome: Outcome, model: FirstTokenModel) -> None:
        """Teach `model` how long the replica took to a first token, from a stream answered
        by the placement's own choice (a failover's time is not the replica's)."""
        decision = outcome.decision
        ahead = decision.ahead_tokens
        seconds = placement.first_token_seconds(outcome)
        if ahead is None or seconds is None:
            return
        prompt, cached = outcome.prompt_tokens, outcome.cached_tokens
        if prompt is not None and cached is not None:
            uncached = prompt - cached
        else:
            # No usage came back: what the decision expected to compute.
            estimate = placement.request.estimated_tokens(self._chars_per_token)
            uncached = max(0, round(estimate) - decision.matched_blocks * self._block_tokens)
        model.observe(decision.backend, ahead + uncached, seconds)

    def _follow(self, placement: Placement) -> Turn | None:
        """The request's place in its conversation (chat, or any request with a session key),
        and why it left its previous replica, judged on the loads it was placed on."""
        request = placement.request
        is_chat = request.endpoint in CONVERSATIONS
        if not is_chat and request.session_key is None:
            return None
        prompt = fingerprint(request.canonical) if is_chat else None
        chosen = placement.backend.name
        turn = self.conversations.follow(request.session_key, prompt, chosen)
        previous = turn.previous_backend
        if turn.continues and previous is not None and previous != chosen:
            turn.miss = miss_cause(
                previous,
                placement.serving.loads,
                placement.decision.load_bound,
                placement.state.matched,
                chosen,
            )
        return turn

    async def _record(self, request: RoutingInput, backend: str, chain: list[int]) -> None:
        if not request.endpoint.by_prefix:
            return
        if request.endpoint is not Endpoint.EMBEDDINGS:
            await self.index.record(request.model, backend, chain)
            # Other gateways hear of it now, not once it is accepted a prefill later: the next
            # request sharing the prefix then follows it wherever it arrives. If the backend
            # never accepts it, `settled` forgets it there again.
            self.index.share(request.model, backend, chain)
        if request.session_key is not None:
            await self.sessions.put(request.session_key, backend)

    def _with_answer(
        self, placement: Placement, answer: str, completion_tokens: int | None
    ) -> list[int]:
        """The chain of the prompt and its answer, which a chat's next turn extends."""
        request = placement.request
        if request.endpoint not in CONVERSATIONS or not answer:
            return placement.chain
        hashed, block = request.hashed(self._block_chars, self._block_tokens)
        tokenizer = self._tokenizer
        if request.tokens is not None and tokenizer is not None:
            if FIELD_TEXT in answer:
                # It called a tool: the template renders the call, which the gateway cannot.
                return placement.chain
            ids = tokenizer.text(answer, add_special_tokens=False)
            if completion_tokens is not None and len(ids) != completion_tokens * TOKEN_BYTES:
                # The engine cached the ids it generated, which this text does not encode back
                # to (it encodes to as many, as a rule, when they are the same).
                return placement.chain
            history = hashed + ids
        else:
            history = hashed + message_segment("assistant", answer)
        seed = chain_seed(request.cache_salt)
        chain = extend_hashes(placement.chain, history, block, seed, self._max_blocks)
        # An answer too short to complete a block adds nothing routing did not record.
        return chain if len(chain) > len(placement.chain) else placement.chain
