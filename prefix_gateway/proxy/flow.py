"""Flow control (`--max-inflight-per-replica N`): at most N requests of this gateway in flight
on one replica — fewer where the engine reports requests this gateway did not send — and the
others waiting here, where their order can be chosen, instead of in the engines' first-come
queues.

Whenever a slot may have freed (a request ended, a request arrived, or at least every
`_RECHECK` s, for health and engine-load changes), the dispatcher picks the next waiting request:
the highest priority first; among tenants of that priority, the one that received the least
service for its weight (tokens: its requests' estimates when dispatched, corrected to the
engine's usage when they end, cached prompt tokens at `--cached-token-cost`); within a tenant,
the oldest. Only a request whose model has a replica with a free slot is picked. The routing
policy then places it among the replicas with a free slot, so that affinity is decided with
the loads of the moment it leaves, not those of its arrival.

One task routes every waiting request, one after another: a slot counted free is taken before
the next request is looked at. A tenant that had nothing waiting starts level with the least
served tenant waiting (it gains no credit for its idle time). A request waits at most
`--queue-timeout` s, and at most `--max-queue` wait at once: beyond, a 429 that says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from prefix_gateway.backends.backend import Backend
from prefix_gateway.backends.pool import BackendPool
from prefix_gateway.config import Settings
from prefix_gateway.config.tenants import ANONYMOUS
from prefix_gateway.errors import GatewayError
from prefix_gateway.metrics import Metrics
from prefix_gateway.prompt.parsing import RoutingInput
from prefix_gateway.refusals import refused
from prefix_gateway.routing.placement import Placement
from prefix_gateway.routing.router import Router
from prefix_gateway.routing.types import Route
from prefix_gateway.tenants.cost import estimated_cost, used_cost
from prefix_gateway.tenants.tenant import Tenant, Usage

log = logging.getLogger("prefix_gateway.flow")

_RECHECK = 0.05
"""Seconds between looks at the replicas while requests wait and nothing else happened."""
_AFFINITY_WAIT = 3.0
"""Seconds a request whose prefix a full replica holds may wait for a slot there rather than be
placed on another replica with a free one."""
_AFFINE = frozenset({Route.SESSION, Route.OWNER, Route.PREFIX})
_ACTIVE = 10.0
"""Seconds after its last request during which a tenant counts as active."""
_MOST_KEPT = 0.25
"""The largest part of a model's slots kept free for quiet tenants."""


@dataclass(eq=False)
class _Waiter:
    request: RoutingInput
    cost: float
    since: float
    placed: asyncio.Future[Placement] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


@dataclass(eq=False)
class _Lane:
    """One tenant's waiting requests and the service it received, per unit of weight: what
    its ended requests used, and the estimates of those still in flight."""

    name: str
    priority: int
    weight: float
    waiting: deque[_Waiter] = field(default_factory=deque)
    settled: float = 0.0
    outstanding: float = 0.0
    in_flight: int = 0
    seen: float = 0.0
    """When its latest request arrived."""

    @property
    def service(self) -> float:
        return self.settled + self.outstanding


class Flow:
    def __init__(
        self, settings: Settings, router: Router, pool: BackendPool, metrics: Metrics
    ) -> None:
        self.capacity = settings.max_inflight_per_replica
        self._router = router
        self._pool = pool
        self._metrics = metrics
        self._queue_limit = settings.max_queue
        self._queue_timeout = settings.queue_timeout
        self._chars_per_token = settings.chars_per_token
        self._completion_estimate = settings.budget_max_tokens
        self._cached_cost = settings.cached_token_cost
        self._lanes: dict[str, _Lane] = {}
        self._held: dict[str, int] = {}
        """Requests dispatched to each backend by this gateway that have not ended."""
        self.waiting = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._dispatch_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def waiting_of(self, name: str) -> int:
        """Requests of tenant `name` (or `anonymous`) waiting now."""
        lane = self._lanes.get(name)
        return 0 if lane is None else len(lane.waiting)

    def room(self, backend: Backend) -> bool:
        """Whether `backend` has a free slot: this gateway's requests and what the engine
        reports beyond them below the capacity."""
        return self._free_slots(backend) > 0

    async def place(self, tenant: Tenant | None, request: RoutingInput) -> Placement:
        """Wait for a free slot for `request` and its placement there; a 429 past the queue's
        bounds, or routing's own refusal."""
        if self.waiting >= self._queue_limit:
            raise refused("overloaded")
        lane = self._lane(tenant)
        waiter = _Waiter(request, self._cost(request), time.monotonic())
        if not lane.waiting:
            lane.settled = max(lane.settled, self._least_settled(lane.priority))
        lane.waiting.append(waiter)
        lane.seen = waiter.since
        self.waiting += 1
        self._wake.set()
        try:
            async with asyncio.timeout(self._queue_timeout):
                placement = await asyncio.shield(waiter.placed)
        except TimeoutError:
            if waiter.placed.done() and not waiter.placed.cancelled():
                return waiter.placed.result()  # placed (or refused) just as the wait ran out
            self._leave(lane, waiter)
            raise refused("queue_timeout") from None
        except GatewayError:
            raise  # routing refused it: it holds no slot
        except BaseException:
            placed = waiter.placed
            if placed.done() and not placed.cancelled() and placed.exception() is None:
                self.ended(tenant, placed.result(), None)  # placed, then the client left
            else:
                self._leave(lane, waiter)
            raise
        finally:
            waited = time.monotonic() - waiter.since
            self._metrics.child(self._metrics.tenants.wait_seconds, lane.name).observe(waited)
        return placement

    def ended(self, tenant: Tenant | None, placement: Placement, usage: Usage | None) -> None:
        """The request placed with `placement` ended: its slot is free, and its tenant's service
        counts what it used as the engine reported it (None, unknown: its estimate)."""
        self._free(placement.backend.name)
        lane = self._lanes.get(ANONYMOUS if tenant is None else tenant.name)
        if lane is None:
            return
        estimate = self._cost(placement.request)
        used = estimate
        if usage is not None:
            used = used_cost(usage.prompt, usage.cached, usage.completion, self._cached_cost)
        lane.outstanding = max(0.0, lane.outstanding - estimate / lane.weight)
        lane.in_flight -= 1
        lane.settled += used / lane.weight

    def _free(self, name: str) -> None:
        left = self._held.get(name, 0) - 1
        if left > 0:
            self._held[name] = left
        else:
            self._held.pop(name, None)
        self._wake.set()

    def _cost(self, request: RoutingInput) -> float:
        return estimated_cost(request, self._chars_per_token, self._completion_estimate)

    def _lane(self, tenant: Tenant | None) -> _Lane:
        name = ANONYMOUS if tenant is None else tenant.name
        lane = self._lanes.get(name)
        if lane is None:
            priority, weight = (
                (0, 1.0) if tenant is None else (tenant.spec.priority, tenant.spec.weight)
            )
            lane = self._lanes[name] = _Lane(name, priority, weight)
        return lane

    def _least_settled(self, priority: int) -> float:
        """Where a tenant that had nothing waiting starts: level with the least served tenant
        of its priority that is waiting (it gains no credit for its idle time)."""
        busy = [
            lane.settled
            for lane in self._lanes.values()
            if lane.waiting and lane.priority == priority
        ]
        return min(busy, default=0.0)

    def _leave(self, lane: _Lane, waiter: _Waiter) -> None:
        with contextlib.suppress(ValueError):
            lane.waiting.remove(waiter)
            self.waiting -= 1
        if not waiter.placed.done():
            waiter.placed.cancel()

    def _next(self, passed: set[_Waiter]) -> tuple[_Lane, _Waiter] | None:
        """The next request to dispatch: by priority, then least service for the weight, then
        age; only one whose model has a free slot beyond those kept for quiet tenants (and not
        one `passed` over this round)."""
        lanes = sorted(
            (
                lane
                for lane in self._lanes.values()
                if lane.waiting and lane.waiting[0] not in passed
            ),
            key=lambda lane: (-lane.priority, lane.service, lane.waiting[0].since),
        )
        now = time.monotonic()
        for lane in lanes:
            head = lane.waiting[0]
            serving = self._pool.serving(head.request.model)
            if serving is None:
                return lane, head  # no replica at all: routing answers why
            free = sum(self._free_slots(backend) for backend in serving.backends)
            most_kept = int(self.capacity * len(serving.backends) * _MOST_KEPT)
            if free > min(self._quiet(lane, now), most_kept):
                return lane, head
        return None

    def _free_slots(self, backend: Backend) -> int:
        return max(0, self.capacity - self._held.get(backend.name, 0) - backend.queued)

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

    async def _dispatch_forever(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_RECHECK if self.waiting else None):
                    await self._wake.wait()
            self._wake.clear()
            passed: set[_Waiter] = set()
            while (found := self._next(passed)) is not None:
                lane, waiter = found
                if await self._holder_is_full(waiter):
                    passed.add(waiter)
                    continue
                if not lane.waiting or lane.waiting[0] is not waiter:
                    continue  # it gave up while its holder was looked up
                lane.waiting.popleft()
                self.waiting -= 1
                await self._dispatch(lane, waiter)

    async def _holder_is_full(self, waiter: _Waiter) -> bool:
        """Whether `waiter` should wait on: the replica that holds its prefix (or its session)
        has no free slot, and it has waited less than `_AFFINITY_WAIT`. Sent elsewhere, it
        would compute its prefix anew there; the holder frees a slot soon."""
        if time.monotonic() - waiter.since >= _AFFINITY_WAIT:
            return False
        try:
            preview = await self._router.decide(waiter.request)
        except Exception:
            return False  # routing will say why when it is dispatched
        decision = preview.decision
        if decision.route not in _AFFINE or not decision.matched_blocks:
            return False
        holder = self._pool.get(decision.backend)
        return holder is not None and not self.room(holder)

    async def _dispatch(self, lane: _Lane, waiter: _Waiter) -> None:
        if waiter.placed.done():
            return  # it gave up meanwhile
        try:
            placement = await self._router.route(waiter.request, self.room)
        except Exception as error:  # the request's to answer; the dispatcher goes on
            if not isinstance(error, GatewayError):
                log.exception("routing a waiting request failed")
            if not waiter.placed.done():
                waiter.placed.set_exception(error)
            return
        name = placement.backend.name
        if waiter.placed.done():  # it gave up while it was routed
            return
        self._held[name] = self._held.get(name, 0) + 1
        lane.outstanding += waiter.cost / lane.weight
        lane.in_flight += 1
        waiter.placed.set_result(placement)
