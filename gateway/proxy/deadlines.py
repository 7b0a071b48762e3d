"""One proxied request in flight, and the watch that cuts short those that overrun.

An `Exchange` knows the task relaying its request and the moment by which that task must next
make progress (`due`): the whole body received, the replica's first byte, the next chunk either
way. Something that gives up on it — the client hanging up, a deadline passing — *interrupts*
it: records why and cancels the task; the proxy reads the reason where the cancellation lands
and answers accordingly (fail over, an error, an SSE error event, or nothing for a client that
left).

One `DeadlineWatch` task checks every exchange a few times per shortest timeout, so that a
chunk costs one clock read and one store instead of a timer of its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import suppress
from typing import Any

from gateway.proxy.asgi import Receive

log = logging.getLogger("gateway.proxy.deadlines")

DISCONNECTED = "disconnected"
"""The client closed the connection."""
CLIENT_STALLED = "client_stalled"
"""The client stopped reading: a chunk waited longer than the idle timeout to be sent."""
BODY = "body"
"""The request body did not arrive in time."""
FIRST_BYTE = "first_byte"
"""The replica sent no first byte in time: this attempt may fail over."""
IDLE = "idle"
"""The replica went quiet inside a response."""
TOTAL = "total"
"""The request as a whole ran past `--request-timeout`."""


class Exchange:
    __slots__ = ("begun", "deadline", "done", "due", "phase", "reason", "streaming", "task")

    def __init__(self, task: asyncio.Task[Any], now: float, request_timeout: float) -> None:
        self.task = task
        self.deadline = now + request_timeout
        self.due = self.deadline
        self.phase = BODY
        self.reason: str | None = None
        self.done = False
        """Set once nothing is left to abort: later interruptions are ignored."""
        self.begun = False
        """The response to the client has begun."""
        self.streaming = False
        """... as a stream of server-sent events."""

    def expect(self, phase: str, seconds: float) -> None:
        """The task must make progress of this kind within `seconds`."""
        self.phase = phase
        self.due = time.monotonic() + seconds

    def interrupt(self, reason: str) -> None:
        if self.reason is None and not self.done:
            self.reason = reason
            self.task.cancel()

    def resume(self) -> None:
        """Carry on after handling an interruption (a failover)."""
        self.reason = None
        self.due = self.deadline
        self.task.uncancel()

    async def watch_client(self, receive: Receive) -> None:
        """Interrupt as soon as the client disconnects (run once the body was read)."""
        message = await receive()
        if message["type"] == "http.disconnect":
            self.interrupt(DISCONNECTED)


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
                exchange.interrupt(TOTAL)
            elif now >= exchange.due:
                exchange.interrupt(exchange.phase)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._tick)
            try:
                self.sweep(time.monotonic())
            except Exception:  # keep watching whatever one exchange did
                log.exception("deadline sweep failed")
