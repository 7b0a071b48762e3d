"""A placement: where one request goes, and the only routing object the proxy holds for it.

`Router.route` makes it and records it; from then on the proxy asks it for the replica and
why (`backend`, `decision`), for the next replica after a failure (`next_after`), tells it
what it hears while the answer streams (`response_stored`, `answer_complete`) and, once,
how the request ended (`settle`). Routing is entered there and nowhere else.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace
from typing import Protocol

from prefix_gateway.backends.backend import Backend, ModelPool
from prefix_gateway.backends.pool import Lease
from prefix_gateway.prompt.parsing import Endpoint, RoutingInput
from prefix_gateway.routing.conversations import Turn
from prefix_gateway.routing.types import Decision, Outcome, Policy, Route, RoutingState
from prefix_gateway.state.agreement import FleetView, SharedPrompt

CONVERSATIONS = frozenset({Endpoint.CHAT, Endpoint.RESPONSES, Endpoint.MESSAGES})
"""Endpoints whose prompts are messages, each turn extending the last with its answer."""


class Recorder(Protocol):
    """Where a placement is recorded for the requests after it
    (`prefix_gateway.routing.recorder`)."""

    async def placed(self, placement: Placement) -> Turn | None: ...

    async def response_stored(self, response_id: str, tenant: str | None, backend: str) -> None: ...

    async def answer_complete(
        self, placement: Placement, backend: str, answer: str, completion_tokens: int | None
    ) -> list[int] | None: ...

    async def settled(self, placement: Placement, outcome: Outcome) -> None: ...


class Observer(Protocol):
    """Who counts a placement and its outcome (`prefix_gateway.routing.observer`)."""

    def placed(self, placement: Placement, seconds: float) -> None: ...

    def settled(self, placement: Placement, outcome: Outcome) -> None: ...


class Placement:
    __slots__ = (
        "_answered",
        "_observer",
        "_policy",
        "_recorder",
        "backend",
        "chain",
        "decision",
        "fleet",
        "pinned",
        "request",
        "serving",
        "shared",
        "slot",
        "state",
        "sticky",
        "turn",
    )

    def __init__(
        self,
        request: RoutingInput,
        chain: list[int],
        decision: Decision,
        serving: ModelPool,
        state: RoutingState,
        policy: Policy,
        *,
        sticky: str | None = None,
        fleet: FleetView | None = None,
        shared: SharedPrompt | None = None,
        pinned: bool = False,
    ) -> None:
        self.request = request
        self.chain = chain
        """The prompt's block hashes."""
        self.decision = decision
        self.serving = serving
        self.backend: Backend = serving.by_name[decision.backend]
        self.state = state
        """What the policy saw to decide."""
        self.sticky = sticky
        """The backend the request's session was bound to, if any."""
        self.fleet = fleet
        """What the fleet answered for it through Redis (None: nothing, or no fleet)."""
        self.shared = shared
        """Its shared prompt as the fleet names it (None: none, or no fleet consulted)."""
        self.pinned = pinned
        """Only `backend` can answer (it holds the response the request names): no failover."""
        self.turn: Turn | None = None
        """The request's place in its conversation (chat, or any request with a session key)."""
        self.slot: Lease | None = None
        """The request in `backend`'s count of requests in flight, from the moment it was
        placed: its first attempt adopts it; settling gives it back if no attempt did."""
        self._policy = policy
        self._recorder: Recorder | None = None
        self._observer: Observer | None = None
        self._answered: list[int] | None = None

    async def commit(self, recorder: Recorder, observer: Observer, seconds: float) -> None:
        """Record the placement for the requests after it; from now on it can be settled."""
        self._recorder, self._observer = recorder, observer
        self.turn = await recorder.placed(self)
        observer.placed(self, seconds)

    @property
    def hears_answer(self) -> bool:
        """Whether `answer_complete` is to hear of the answer: a conversation's, whose next
        turn extends it."""
        return not self.pinned and self.request.endpoint in CONVERSATIONS

    @property
    def hears_response_id(self) -> bool:
        """Whether `response_stored` is to hear of the Responses API response's id."""
        request = self.request
        return request.endpoint is Endpoint.RESPONSES and request.response_id is None

    def next_after(self, tried: Collection[str]) -> tuple[Backend, Decision] | None:
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
        choice = self._policy.choose(state)
        retry = Decision(choice.backend, Route.RETRY, choice.matched_blocks, choice.load_bound)
        return serving.by_name[choice.backend], retry

    async def response_stored(self, response_id: str, backend: str) -> None:
        """`backend` made the Responses API response `response_id`: requests naming it go
        there. Heard before the client can name it."""
        assert self._recorder is not None
        await self._recorder.response_stored(response_id, self.request.owner, backend)

    async def answer_complete(
        self, backend: str, answer: str, completion_tokens: int | None
    ) -> None:
        """`backend` answered in full; its client does not have the last bytes yet. Never
        raises: the answer is the client's whatever becomes of recording it."""
        assert self._recorder is not None
        self._answered = await self._recorder.answer_complete(
            self, backend, answer, completion_tokens
        )

    @property
    def answered_chain(self) -> list[int] | None:
        """The chain of prompt and answer once `answer_complete` recorded it (else None)."""
        return self._answered

    def unsent(self, status: int) -> Outcome:
        """The outcome of the request when it never reached its backend (`status`: what its
        client was told, 499 when nobody was left to tell)."""
        return Outcome(status, self.decision, (self.backend.name,))

    async def settle(self, outcome: Outcome) -> None:
        """Take in how the request ended, once: its slot given back if no attempt took it,
        counted, and recorded for the requests after (what it recorded when it was placed is
        withdrawn where it never arrived)."""
        if self.slot is not None:
            self.slot.release()
        assert self._recorder is not None and self._observer is not None
        self._observer.settled(self, outcome)
        await self._recorder.settled(self, outcome)

    def first_token_seconds(self, outcome: Outcome) -> float | None:
        """The time to first token of the replica the placement chose, where `outcome` shows
        it: a stream answered there (not a failover's), from sending it to its first byte."""
        if (
            outcome.status != 200
            or outcome.decision is not self.decision
            or not self.request.stream
            or not outcome.first_byte_at > outcome.sent_at
        ):
            return None
        return outcome.first_byte_at - outcome.sent_at

    def affinity(self, served: str) -> str | None:
        """`hit` or `miss` for a request that continues its conversation, answered by `served`."""
        turn = self.turn
        if turn is None or not turn.continues:
            return None
        return "hit" if turn.previous_backend == served else "miss"

    @property
    def cache_break(self) -> str | None:
        turn = self.turn
        return turn.cause.value if turn is not None and turn.cause is not None else None
