"""One try at one replica, and what it holds while it runs: its backend's slot until it ends
(the placement's, for the first attempt; its own, for a retry elsewhere), its pending prefill
until its first byte and, for a stream, a place among the prefills in progress. Leaving gives
back whatever is left, however the attempt ended.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from types import TracebackType

from prefix_gateway.backends.pool import Lease
from prefix_gateway.backends.prefill_speed import PrefillSpeed
from prefix_gateway.proxy.deadlines import Exchange, Why
from prefix_gateway.proxy.prefills import Computing, Prefills
from prefix_gateway.routing.types import Decision
from prefix_gateway.state.agreement import SharedPrompt


class Attempt:
    __slots__ = (
        "_computing",
        "_exchange",
        "_fleet_computing",
        "_lease",
        "_pending",
        "_prefills",
        "_shared",
        "_speed",
        "_streamed",
        "backend",
        "blocks_ahead",
        "chain",
        "decision",
        "first_byte_at",
        "judged_from",
        "sent_at",
        "started",
    )

    def __init__(
        self,
        lease: Lease,
        decision: Decision,
        chain: Sequence[int],
        prefills: Prefills | None,
        streamed: bool,
        exchange: Exchange,
        speed: PrefillSpeed,
        shared: SharedPrompt | None = None,
        fleet_computing: frozenset[str] = frozenset(),
    ) -> None:
        """`shared`: the request's shared prompt as the fleet names it; `fleet_computing`: the
        backends where, as the fleet said when it was routed, a stream computes it."""
        backend = lease.backend
        self.backend = backend
        self.decision = decision
        self.chain = chain
        self.started = 0.0
        """`time.perf_counter()` when the request was sent to the replica."""
        self.first_byte_at = 0.0
        self.sent_at = 0.0
        """`time.monotonic()` when it was sent."""
        self.judged_from = 0.0
        """`time.monotonic()` from which its replica's silence counts: when it was sent, and
        again whenever its client takes a chunk it was waiting for (the relay sets it)."""
        self.blocks_ahead = 0
        self._exchange = exchange
        self._speed = speed
        self._lease = lease
        self._pending = max(0, len(chain) - decision.matched_blocks)
        self._prefills = prefills
        """Prefills in progress, where this attempt may wait (None: prefill waits are off)."""
        self._streamed = streamed
        self._shared = shared
        self._fleet_computing = backend.name in fleet_computing
        self._computing: Computing | None = None

    def __enter__(self) -> Attempt:
        if not self._lease.held:
            self._lease.take()
        self.backend.prefill_queued(self._pending)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._prefilled()
        self.backend.attempt_ended(self)
        self._lease.release()

    async def take_turn(self) -> None:
        """Wait for a stream computing this prompt's matched prefix here (of this gateway, or
        of another computing its shared prompt); then, if streamed, announce this attempt's
        own prefill (to the fleet too, when it computes part of the shared prompt)."""
        prefills = self._prefills
        if prefills is None:
            return
        name, depth = self.backend.name, self.decision.matched_blocks
        shared = self._shared
        earlier = prefills.earlier(name, self.chain, depth)
        if earlier is not None:
            await prefills.wait(earlier)
        elif shared is not None and self._fleet_computing:
            await prefills.wait_for_fleet(shared, name)
            depth = max(depth, shared.blocks)  # computed there by the other stream
        if self._streamed and depth < len(self.chain):
            self._computing = prefills.begin(name, self.chain, depth, shared)

    def sent(self) -> None:
        backend = self.backend
        self.started = time.perf_counter()
        self.sent_at = self.judged_from = time.monotonic()
        self.blocks_ahead = backend.pending_prefill
        backend.attempt_sent(self)

    @property
    def awaiting_client(self) -> bool:
        """Its relay waits for the client to take a chunk: meanwhile its replica cannot send."""
        return self._exchange.phase is Why.CLIENT_STALLED

    def stop(self) -> None:
        """Its backend stalled: before the first byte it moves elsewhere, after it fails."""
        self._exchange.interrupt(Why.STALLED)

    def reached_first_byte(self) -> float:
        """The prefill is over; the seconds since the request was sent."""
        self.first_byte_at = time.perf_counter()
        waited = self.first_byte_at - self.started
        self.backend.progressed(self.sent_at + waited)
        self._speed.observe(self.blocks_ahead, waited)
        self._prefilled()
        return waited

    def _prefilled(self) -> None:
        if self._pending:
            self.backend.prefill_ended(self._pending)
            self._pending = 0
        computing = self._computing
        if computing is not None:
            self._computing = None
            assert self._prefills is not None
            self._prefills.end(computing)
