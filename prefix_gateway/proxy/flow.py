"""Flow control (`--max-inflight-per-replica N`): at most N requests of this gateway in flight
on one replica — fewer where the engine reports requests this gateway did not send — and the
others waiting here, where their order can be chosen, instead of in the engines' first-come
queues. While it is on, this queue is the only way to a replica: a request naming a stored
response waits in it too, for a slot on the replica that holds that response.

Whenever a slot may have freed (a request ended, a request arrived, or at least every
`_RECHECK` s while requests wait, for health and engine-load changes), the dispatcher gives
the next waiting request its turn: the highest priority first; among tenants of that priority,
the one that received the least service for its weight (tokens: what its requests reserved
while they run, what they were charged once they end); within a tenant, the oldest. Only a
request whose replica can take it gets its turn: one with a free slot serving its model, its
stored response's replica, or the replica holding its prefix (for at most `_AFFINITY_WAIT` s:
sent elsewhere, it would compute its prefix anew there).

The dispatcher never waits: it reads the replicas' counts and what each waiting request said
it waits for, and hands out turns. Each request then places itself, in its own task, with the
routing policy among the replicas with a free slot at that moment (so that affinity is decided
with the loads of the moment it leaves, not those of its arrival), and takes its slot there —
the backend's own count of requests in flight, the only one. Until it has, its turn counts
against its model's free slots, so that no more turns are given than there are slots; a request
that finds every slot taken after all goes back to the head of its tenant's line.

Service is counted from where the queue stands: each priority has a level, the service of the
tenant last given a turn (as in start-time fair queueing, where it is the virtual time), and a
tenant that had nothing waiting starts at that level if it is behind it. It gains no credit for
its idle time, and owes nothing for what it was served while no one else wanted the replicas.

A request waits at most `--queue-timeout` s, and at most `--max-queue` wait at once: beyond, a
429 that says so. Whatever ends a request, its place here is given back once, by `release`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import Enum

from prefix_gateway.backends.backend import Backend
from prefix_gateway.backends.pool import BackendPool
from prefix_gateway.config import Settings
from prefix_gateway.metrics import Metrics
from prefix_gateway.refusals import refused
from prefix_gateway.routing.placement import Placement
from prefix_gateway.routing.router import NoRoom, Placing

log = logging.getLogger("prefix_gateway.flow")

_RECHECK = 0.05
"""Seconds between looks at the replicas while requests wait and nothing else happened."""
_AFFINITY_WAIT = 3.0
"""Seconds a request whose prefix a full replica holds may wait for a slot there rather than be
placed on another replica with a free one."""
_ACTIVE = 10.0
"""Seconds after its last request during which a tenant counts as active."""
_MOST_KEPT = 0.25
"""The largest part of a model's slots kept free for quiet tenants."""

Holder = Callable[[], Awaitable[Backend | None]]
"""Looks up the replica a request waits for (`Placing.holder`); called only when it matters."""


class Stage(Enum):
    WAITING = "waiting"
    TURN = "turn"
    """Given its turn: placing itself."""
    PLACED = "placed"
    """Holding a replica's slot."""
    GONE = "gone"
    """Released."""


@dataclass(eq=False)
class _Lane:
    """One tenant's waiting requests and the service it received, per unit of weight: what
    its ended requests were charged, and the reservations of those given their turn."""

    name: str
    priority: int
    weight: float
    waiting: deque[Ticket] = field(default_factory=deque)
    settled: float = 0.0
    outstanding: float = 0.0
    in_flight: int = 0
    seen: float = 0.0
    """When its latest request arrived."""

    @property
    def service(self) -> float:
        return self.settled + self.outstanding


@dataclass(eq=False)
class Ticket:
    """One request's place in the flow: in its tenant's line, then holding its turn, then its
    replica's slot, until `Flow.release`."""

    lane: _Lane
    cost: float
    """The tokens it reserves (its service while it runs)."""
    model: str
    since: float
    holder: Backend | None = None
    """The replica it waits for, if only one will do (or one is worth waiting for)."""
    pinned: bool = False
    """Only `holder` can answer it (it names a stored response held there)."""
    looked_up: bool = False
    stage: Stage = Stage.WAITING
    turn: asyncio.Future[None] | None = None


class Flow:
    def __init__(self, settings: Settings, pool: BackendPool, metrics: Metrics) -> None:
        self.capacity = settings.max_inflight_per_replica
        self._pool = pool
        self._metrics = metrics
        self._queue_limit = settings.max_queue
        self._queue_timeout = settings.queue_timeout
        self._lanes: dict[str, _Lane] = {}
        self._turns: dict[str, int] = {}
        """Per model, the requests given their turn that have not placed themselves yet."""
        self._turns_at: dict[str, int] = {}
        """The same per backend, for requests that can go to one backend only."""
        self._level: dict[int, float] = {}
        """Per priority, the service of the tenant last given a turn: where a tenant that had
        nothing waiting starts."""
        self.waiting = 0
        self._closed = False
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._dispatch_forever(), name="flow-dispatch")

    async def stop(self) -> None:
        """No more turns: every request still waiting is refused (`shutting_down`) at once."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for lane in self._lanes.values():
            for ticket in lane.waiting:
                if ticket.turn is not None and not ticket.turn.done():
                    ticket.turn.set_exception(refused("shutting_down"))

    def waiting_of(self, name: str) -> int:
        """Requests of tenant `name` waiting now."""
        lane = self._lanes.get(name)
        return 0 if lane is None else len(lane.waiting)

    def room(self, backend: Backend) -> bool:
        """Whether `backend` has a free slot: this gateway's requests and what the engine
        reports beyond them below the capacity."""
        return self._free_slots(backend) > 0

    def enter(self, name: str, priority: int, weight: float, cost: float, model: str) -> Ticket:
        """A request of tenant `name` (of `priority` and `weight`) reserving `cost` tokens
        joins the flow; it waits for nothing yet (`turn`)."""
        lane = self._lanes.get(name)
        if lane is None:
            lane = self._lanes[name] = _Lane(name, priority, weight)
        now = time.monotonic()
        lane.seen = now
        return Ticket(lane, cost, model, now)

    async def turn(self, ticket: Ticket, holder: Holder) -> None:
        """Wait for `ticket`'s turn (again, after a placement found no room); a 429 past the
        queue's bounds. `holder` is asked which replica it waits for once, and only when a
        replica of its model is full (or it names a stored response)."""
        if self._closed:
            raise refused("shutting_down")
        front = ticket.stage is Stage.TURN
        if front:
            self._return_turn(ticket)  # it found no room after all: it waits again, first
        if not ticket.looked_up and (ticket.pinned or self._some_full(ticket.model)):
            ticket.holder = await holder()
            ticket.looked_up = True
        if not front and not self.waiting and self._fits(ticket, time.monotonic()):
            self._give_turn(ticket)
            return
        if self.waiting >= self._queue_limit:
            raise refused("overloaded")
        await self._wait(ticket, front)

    async def _wait(self, ticket: Ticket, front: bool) -> None:
        lane = ticket.lane
        if not lane.waiting:
            lane.settled = max(lane.settled, self._level.get(lane.priority, 0.0))
        ticket.turn = asyncio.get_running_loop().create_future()
        if front:
            lane.waiting.appendleft(ticket)
        else:
            lane.waiting.append(ticket)
        self.waiting += 1
        self._wake.set()
        try:
            left = ticket.since + self._queue_timeout - time.monotonic()
            async with asyncio.timeout(max(0.0, left)):
                await asyncio.shield(ticket.turn)
        except TimeoutError:
            if ticket.stage is Stage.TURN:
                return  # given its turn just as the wait ran out
            raise refused("queue_timeout") from None
        finally:
            if ticket.stage is Stage.WAITING:
                self._leave_line(ticket)
            waited = time.monotonic() - ticket.since
            metrics = self._metrics
            metrics.child(metrics.tenants.wait_seconds, lane.name).observe(waited)

    async def place(self, ticket: Ticket, placing: Placing) -> Placement:
        """`ticket`'s request placed once its turn came, among the replicas with a free slot
        then; it waits again, first in its tenant's line, when another request took the room
        it was given its turn for."""
        while True:
            await self.turn(ticket, placing.holder)
            try:
                placement = await placing.place(self.room_for(ticket))
            except NoRoom:
                continue
            self.placed(ticket)
            return placement

    def room_for(self, ticket: Ticket) -> Callable[[Backend], bool]:
        """Which replicas may take `ticket`'s request as it places itself: those with a free
        slot, its own turn not counted against the one it can only go to."""
        holder = ticket.holder
        if not ticket.pinned or holder is None:
            return self.room
        return lambda backend: self._free_slots(backend) + (backend is holder) > 0

    def placed(self, ticket: Ticket) -> None:
        """The request took its replica's slot: its turn is used."""
        if ticket.stage is Stage.TURN:
            self._return_turn(ticket)
        ticket.stage = Stage.PLACED
        lane = ticket.lane
        lane.in_flight += 1
        lane.outstanding += ticket.cost / lane.weight

    def release(self, ticket: Ticket, charged: float) -> None:
        """The request ended, `charged` tokens for what it used: whatever it held here is given
        back, once, and its tenant's service counts the charge."""
        stage = ticket.stage
        if stage is Stage.GONE:
            return
        lane = ticket.lane
        if stage is Stage.WAITING:
            self._leave_line(ticket)
        elif stage is Stage.TURN:
            self._return_turn(ticket)
        else:
            lane.in_flight -= 1
            lane.outstanding = max(0.0, lane.outstanding - ticket.cost / lane.weight)
        ticket.stage = Stage.GONE
        lane.settled += charged / lane.weight
        self._wake.set()

    def _give_turn(self, ticket: Ticket) -> None:
        lane = ticket.lane
        level = self._level.get(lane.priority, 0.0)
        if lane.service > level:
            self._level[lane.priority] = lane.service
        ticket.stage = Stage.TURN
        if ticket.pinned and ticket.holder is not None:
            name = ticket.holder.name
            self._turns_at[name] = self._turns_at.get(name, 0) + 1
        else:
            self._turns[ticket.model] = self._turns.get(ticket.model, 0) + 1
        if ticket.turn is not None and not ticket.turn.done():
            ticket.turn.set_result(None)

    def _return_turn(self, ticket: Ticket) -> None:
        """The turn given to `ticket` no longer counts against its replicas' free slots."""
        if ticket.pinned and ticket.holder is not None:
            _drop_one(self._turns_at, ticket.holder.name)
        else:
            _drop_one(self._turns, ticket.model)
        ticket.stage = Stage.WAITING
        self._wake.set()

    def _leave_line(self, ticket: Ticket) -> None:
        with contextlib.suppress(ValueError):
            ticket.lane.waiting.remove(ticket)
            self.waiting -= 1
        turn = ticket.turn
        if turn is not None and not turn.done():
            turn.cancel()

    def _free_slots(self, backend: Backend) -> int:
        taken = backend.in_flight + backend.queued + self._turns_at.get(backend.name, 0)
        return max(0, self.capacity - taken)

    def _some_full(self, model: str) -> bool:
        serving = self._pool.serving(model)
        return serving is not None and any(
            self._free_slots(backend) <= 0 for backend in serving.backends
        )

    def _fits(self, ticket: Ticket, now: float) -> bool:
        """Whether `ticket` may have its turn now: the replica it waits for has a free slot
        (the one its stored response is on; the one holding its prefix, for a while), and
        its model's replicas a free slot beyond the turns already given and those kept for
        quiet tenants."""
        holder = ticket.holder
        if (
            holder is not None
            and (ticket.pinned or now - ticket.since < _AFFINITY_WAIT)
            and not self.room(holder)
        ):
            return False
        serving = self._pool.serving(ticket.model)
        if serving is None:
            return True  # no replica of its model at all: placing it says why
        free = sum(self._free_slots(backend) for backend in serving.backends)
        free -= self._turns.get(ticket.model, 0)
        most_kept = int(self.capacity * len(serving.backends) * _MOST_KEPT)
        return free > min(self._quiet(ticket.lane, now), most_kept)

    def _quiet(self, lane: _Lane, now: float) -> int:
        """Tenants of `lane`'s priority or above, active lately, with nothing waiting or in
        flight: a slot is kept free for each (up to `_MOST_KEPT` of them), so that a tenant
        sending one request at a time does not wait behind one that fills every slot."""
        return sum(
            1
            for other in self._lanes.values()
            if other is not lane
            and other.priority >= lane.priority
            and not other.waiting
            and not other.in_flight
            and now - other.seen < _ACTIVE
        )

    def _next(self, now: float) -> Ticket | None:
        """The next request to give its turn: by priority, then least service for the weight,
        then age; the head of a tenant's line only, and only one that fits now."""
        heads = sorted(
            (lane for lane in self._lanes.values() if lane.waiting),
            key=lambda lane: (-lane.priority, lane.service, lane.waiting[0].since),
        )
        for lane in heads:
            head = lane.waiting[0]
            if self._fits(head, now):
                return head
        return None

    def _dispatch(self) -> None:
        """Give every turn that fits now."""
        now = time.monotonic()
        while (ticket := self._next(now)) is not None:
            ticket.lane.waiting.popleft()
            self.waiting -= 1
            self._give_turn(ticket)

    async def _dispatch_forever(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_RECHECK if self.waiting else None):
                    await self._wake.wait()
            self._wake.clear()
            try:
                self._dispatch()
            except Exception:  # the queue must go on whatever one request did
                log.exception("giving waiting requests their turn failed")


def _drop_one(counts: dict[str, int], key: str) -> None:
    left = counts.get(key, 0) - 1
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)
