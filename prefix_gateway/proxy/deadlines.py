"""Deadlines of the requests in flight, and the one task that enforces them: an `Exchange`
holds when its request must next progress and end, `DeadlineWatch` checks them all a few
times per shortest timeout, and `Exchange.guard()` turns an interruption into `Interrupted`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import suppress
from enum import Enum
from types import TracebackType
from typing import Any, Protocol

from prefix_gateway.errors import GatewayError
from prefix_gateway.proxy.asgi import Receive
from prefix_gateway.refusals import refused

log = logging.getLogger("prefix_gateway.proxy")


class Why(Enum):
    """Why a request was interrupted, named after what it was waiting for."""

    BODY = "body"
    FIRST_BYTE = "first_byte"
    IDLE = "idle"
    """The replica went quiet inside a response."""
    CLIENT_STALLED = "client_stalled"
    """The client stopped reading: a chunk waited too long to be taken."""
    TOTAL = "total"
    DISCONNECTED = "disconnected"
    STALLED = "stalled"
    """The replica stopped producing anything: the stall watch took it out."""


_CODES = {
    Why.BODY: "body_timeout",
    Why.FIRST_BYTE: "first_byte_timeout",
    Why.IDLE: "stream_idle_timeout",
    Why.TOTAL: "request_timeout",
    Why.STALLED: "upstream_stalled",
}
"""The refusal (`prefix_gateway/refusals.py`) each interruption but the client's own comes to."""


def client_error(why: Why | None, seconds: float = 0.0) -> GatewayError | None:
    """What the client is told of an interruption, `seconds` the limit that ran out; None when
    the client itself went away (nobody to answer: counted as 499). `why` None: the server
    cancelled the request at the end of its shutdown grace."""
    if why is None:
        return refused("shutting_down")
    code = _CODES.get(why)
    return None if code is None else refused(code, seconds)


CLIENT_CONNECTION = "gateway.client_connection"
"""A scope key the server sets to the request's `ClientConnection`. Without it, the handler
listens for the client's disconnect with a task of its own (`Exchange.watch_client`)."""


class Interrupted(Exception):
    def __init__(self, why: Why) -> None:
        super().__init__(why.value)
        self.why = why


class Exchange:
    __slots__ = ("deadline", "done", "due", "phase", "reason", "task")

    def __init__(self, task: asyncio.Task[Any], now: float, request_timeout: float) -> None:
        self.task = task
        self.deadline = now + request_timeout
        self.due = self.deadline
        self.phase = Why.BODY
        self.reason: Why | None = None
        self.done = False
        """Nothing is left to interrupt: later deadlines and hang-ups are ignored."""

    def expect(self, phase: Why, seconds: float) -> None:
        """The task waits for `phase` now, at most `seconds`."""
        self.phase = phase
        self.due = time.monotonic() + seconds

    def interrupt(self, why: Why) -> None:
        if self.reason is None and not self.done:
            self.reason = why
            self.task.cancel()

    def finish(self) -> None:
        self.done = True

    def guard(self) -> _Guard:
        """`with exchange.guard():` raises `Interrupted` where an interruption lands."""
        return _Guard(self)

    async def watch_client(self, receive: Receive) -> None:
        """Interrupt as soon as the client disconnects (run once the body was read), where
        the server does not watch the connection itself (`CLIENT_CONNECTION`)."""
        message = await receive()
        if message["type"] == "http.disconnect":
            self.interrupt(Why.DISCONNECTED)


class ClientConnection(Protocol):
    """The client's connection, as the server that holds it offers it to a request."""

    @property
    def peer(self) -> str:
        """The address at the connection's other end: a proxy's, behind one."""
        ...

    def watch(self, exchange: Exchange) -> None:
        """Interrupt `exchange` if the connection is lost before it is done."""
        ...

    def drop(self) -> None:
        """Close the connection now, discarding what waits to be sent."""
        ...


class _Guard:
    __slots__ = ("_exchange",)

    def __init__(self, exchange: Exchange) -> None:
        self._exchange = exchange

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        exchange = self._exchange
        if kind is None or not issubclass(kind, asyncio.CancelledError):
            return
        why = exchange.reason
        if why is None:  # not ours: the server cancels what still runs at the end of shutdown
            return
        exchange.reason = None
        exchange.task.uncancel()
        if why is Why.FIRST_BYTE or why is Why.STALLED:
            exchange.due = exchange.deadline  # a next attempt sets its own
        else:
            exchange.done = True
        raise Interrupted(why) from None


class DeadlineWatch:
    def __init__(self, shortest_timeout: float) -> None:
        # A deadline is noticed at most a tick late: an eighth of the shortest timeout.
        self._tick = min(1.0, max(0.01, shortest_timeout / 8))
        self._live: set[Exchange] = set()
        self._task: asyncio.Task[None] | None = None

    def add(self, exchange: Exchange) -> None:
        self._live.add(exchange)

    def discard(self, exchange: Exchange) -> None:
        self._live.discard(exchange)

    def __len__(self) -> int:
        return len(self._live)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="deadline-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with suppress(asyncio.CancelledError):
                await self._task

    def sweep(self, now: float) -> None:
        # interrupt() only schedules cancellations: the set does not change under the loop.
        for exchange in self._live:
            if now >= exchange.deadline:
                exchange.interrupt(Why.TOTAL)
            elif now >= exchange.due:
                exchange.interrupt(exchange.phase)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._tick)
            try:
                self.sweep(time.monotonic())
            except Exception:  # keep watching whatever one exchange did
                log.exception("deadline sweep failed")
