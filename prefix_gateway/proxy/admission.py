"""Admission: at most `limit` requests proxied at once and `queue_limit` more waiting (FIFO, at
most `queue_timeout` s); beyond that, refused at once. A finished request hands its slot to
the oldest waiter. The fast path is one comparison and one increment.

A request is admitted once its body is in, so that a slow client holds no slot. Its body counts
against `BodyBytes`, one budget for the bodies of every request the gateway holds, from the
first byte read until the request ends (queued or not): a `BodyLease` of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque


class Admission:
    def __init__(self, limit: int, queue_limit: int, queue_timeout: float) -> None:
        self.limit = limit
        self.queue_limit = queue_limit
        self.queue_timeout = queue_timeout
        self.active = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def try_enter(self) -> bool:
        """Take a slot if one is free now."""
        if self.active < self.limit:
            self.active += 1
            return True
        return False

    async def enter(self) -> str | None:
        """Take a slot, waiting in the queue if need be; else the refusal's cause: `overloaded`
        (the queue is full) or `queue_timeout`."""
        if self.try_enter():
            return None
        if len(self._waiters) >= self.queue_limit or self.queue_timeout <= 0:
            return "overloaded"
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            # Not `wait_for`: before Python 3.12 it swallows a cancellation that comes as the
            # slot is handed over, and a client that left would take the slot.
            async with asyncio.timeout(self.queue_timeout):
                await asyncio.shield(waiter)
        except TimeoutError:
            if waiter.done() and not waiter.cancelled():
                return None  # a slot was handed over just as the wait ran out
            waiter.cancel()
            return "queue_timeout"
        except BaseException:
            # Cancelled while queued: a slot handed over meanwhile goes to the next waiter.
            if waiter.done() and not waiter.cancelled():
                self.leave()
            else:
                waiter.cancel()
            raise
        finally:
            if not waiter.done() or waiter.cancelled():
                self._discard(waiter)
        return None

    def leave(self) -> None:
        """Give a slot back: to the oldest live waiter, else to the pool."""
        waiters = self._waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.active -= 1

    def _discard(self, waiter: asyncio.Future[None]) -> None:
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)


class BodyBytes:
    """The bytes of request bodies held at once, all of them together, and their limit."""

    __slots__ = ("held", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def fits(self, size: int) -> bool:
        """Whether `size` more bytes would stay within the budget now."""
        return self.held + size <= self.limit

    def lease(self) -> BodyLease:
        """A lease for one body's bytes, taken as they are read."""
        return BodyLease(self)


class BodyLease:
    """One body's bytes in the budget: taken chunk by chunk, given back once."""

    __slots__ = ("_budget", "held")

    def __init__(self, budget: BodyBytes) -> None:
        self._budget = budget
        self.held = 0

    def fits(self, size: int) -> bool:
        """Whether `size` more bytes would stay within the budget now."""
        return self._budget.fits(size)

    def take(self, size: int) -> bool:
        """Count `size` more bytes, unless they would pass the budget."""
        budget = self._budget
        held = budget.held + size
        if held > budget.limit:
            return False
        budget.held = held
        self.held += size
        return True

    def release(self) -> None:
        self._budget.held -= self.held
        self.held = 0
