"""The link to Redis: one bounded client, a deadline on every call, background writes, and a
link marked down on failure until a PING with backoff answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    ClusterError,
    NoPermissionError,
    RedisClusterException,
    RedisError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from prefix_gateway.metrics import Metrics

log = logging.getLogger("prefix_gateway.redis")

T = TypeVar("T")
_START_SECONDS = 2.0
_WARM_CONNECTIONS = 4
_WRITE_TIMEOUT_FACTOR = 10
RedisClient = Redis | RedisCluster

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
SCHEMES = ("redis", "rediss", "unix", *CLUSTER_SCHEMES)

# Errors that say "the link is broken or too slow", as opposed to an error reply to one command.
# RuntimeError too: redis-py writing on a connection whose server just died gets uvloop's
# "unable to perform operation on <TCPTransport closed=True>", not a ConnectionError.
_LINK_ERRORS = (
    RedisConnectionError,
    RedisTimeoutError,
    TimeoutError,
    OSError,
    RuntimeError,
    ClusterError,
    RedisClusterException,
)


_REFUSED = (AuthenticationError, AuthorizationError, NoPermissionError)


class RedisUnavailable(Exception):
    """Redis did not answer this operation in time (or is known to be down): use local state."""


def open_client(url: str, timeout: float, max_connections: int) -> RedisClient:
    """A client whose connections are bounded and whose commands are retried at most once."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"Redis URL {url!r}: scheme must be one of {', '.join(SCHEMES)}")
    # Sockets get a generous deadline of their own; requests are bounded by `timeout` above it.
    socket_timeout = max(1.0, 10 * timeout)
    if parts.scheme in CLUSTER_SCHEMES:
        plain = urlunsplit(parts._replace(scheme=CLUSTER_SCHEMES[parts.scheme]))
        return RedisCluster.from_url(
            plain,
            max_connections=max_connections,
            socket_timeout=socket_timeout,
            socket_connect_timeout=socket_timeout,
        )
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=timeout,
        socket_timeout=socket_timeout,
        socket_connect_timeout=socket_timeout,
        # One immediate retry replaces a pooled connection that died with a restarted server.
        retry=Retry(NoBackoff(), 1),
    )
    # The client owns the pool, so closing the client closes its connections too.
    return Redis.from_pool(pool)


class RedisLink:
    def __init__(
        self,
        client: RedisClient,
        timeout: float,
        metrics: Metrics,
        max_pending: int,
        backoff_min: float = 0.05,
        backoff_max: float = 1.0,
    ) -> None:
        self.client = client
        self.timeout = timeout
        self._metrics = metrics
        self._max_pending = max(1, max_pending)
        self._backoff = (backoff_min, backoff_max)
        self._up = False
        self._down_since = time.monotonic()
        self._reconnecting: asyncio.Task[None] | None = None
        self._pending: set[asyncio.Task[None]] = set()
        self._closed = False
        self._lost_write_at = -math.inf
        self._refused = False
        self._scripts: list[str] = []
        self._companions: list[tuple[Callable[[], None], Callable[[], Awaitable[None]]]] = []

    @property
    def up(self) -> bool:
        return self._up

    @property
    def pending(self) -> int:
        return len(self._pending)

    def preload(self, *scripts: str) -> None:
        """Scripts to load whenever the link comes up, so no lookup pays for NOSCRIPT."""
        self._scripts.extend(scripts)

    def run_while_open(
        self, start: Callable[[], None], stop: Callable[[], Awaitable[None]]
    ) -> None:
        """A background job over this link: started with it, stopped before it closes."""
        self._companions.append((start, stop))

    async def start(self) -> None:
        """Connect if Redis answers now (with more patience than a request's deadline: a
        cluster client discovers its nodes); otherwise serve locally and keep trying."""
        for begin, _ in self._companions:
            begin()
        patience = max(self.timeout, _START_SECONDS)
        if not await self._ping(patience):
            if not self._refused:
                log.warning("Redis does not answer; serving from local state until it does")
            self._mark_down()
            return
        # Open a few connections now rather than on the first requests' deadlines.
        with contextlib.suppress(RedisError, *_LINK_ERRORS):
            async with asyncio.timeout(patience):
                await asyncio.gather(*(self._ping_once() for _ in range(_WARM_CONNECTIONS)))

    async def call(
        self, operation: str, work: Callable[[], Awaitable[T]], timeout: float | None = None
    ) -> T:
        """Run `work` against Redis within the timeout, or raise RedisUnavailable."""
        if not self._up:
            raise RedisUnavailable(operation)
        started = time.perf_counter()
        try:
            async with asyncio.timeout(timeout or self.timeout):
                result = await work()
        except _LINK_ERRORS as error:
            self._metrics.redis_errors.labels(operation).inc()
            log.warning("Redis %s failed (%r); falling back to local state", operation, error)
            self._mark_down()
            raise RedisUnavailable(operation) from error
        except RedisError as error:
            # An error reply (out of memory, a script error): this operation only.
            self._metrics.redis_errors.labels(operation).inc()
            log.warning("Redis %s: %s", operation, error)
            raise RedisUnavailable(operation) from error
        self._metrics.redis_seconds.labels(operation).observe(time.perf_counter() - started)
        return result

    def submit(self, operation: str, work: Callable[[], Awaitable[object]]) -> bool:
        """Write in the background, unless Redis is down or `max_pending` writes are in flight
        (then the write is counted as lost and False returned)."""
        return self._background(operation, work) is not None

    async def write_soon(self, operation: str, work: Callable[[], Awaitable[object]]) -> None:
        """Write in the background and wait for it at most a lookup's deadline: a caller
        about to answer its client waits no longer for Redis than a lookup would, and a write
        still queued in Redis then goes on (within its own deadline) without failing."""
        task = self._background(operation, work)
        if task is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), self.timeout)

    def _background(
        self, operation: str, work: Callable[[], Awaitable[object]]
    ) -> asyncio.Task[None] | None:
        if not self._up or len(self._pending) >= self._max_pending or self._closed:
            self._lost_write_at = time.monotonic()
            self.fell_back(operation)
            return None
        task = asyncio.create_task(self._write(operation, work))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return task

    def fell_back(self, operation: str) -> None:
        self._metrics.redis_fallbacks.labels(operation).inc()

    def seconds_since_lost_write(self) -> float:
        """Since Redis last missed a write (down, failed or dropped): it may lack what we know."""
        return time.monotonic() - self._lost_write_at

    async def close(self) -> None:
        """Let writes in flight finish (within the timeout), stop reconnecting, disconnect."""
        self._closed = True
        for _, end in self._companions:
            await end()
        if self._pending:
            await asyncio.wait(set(self._pending), timeout=self.timeout)
        for task in (*self._pending, self._reconnecting):
            if task is not None:
                task.cancel()
        self._up = False
        self._metrics.redis_up.set(0)
        await self.client.aclose()

    @property
    def write_timeout(self) -> float:
        """A write's deadline: a burst of long prompts' writes queued in Redis may take longer
        than a lookup's deadline without the link being down."""
        return max(_WRITE_TIMEOUT_FACTOR * self.timeout, 0.5)

    async def write(self, operation: str, work: Callable[[], Awaitable[object]]) -> bool:
        """Write now, within the write deadline; False (counted) when Redis did not take it."""
        try:
            await self.call(operation, work, self.write_timeout)
        except RedisUnavailable:
            self._lost_write_at = time.monotonic()
            self.fell_back(operation)
            return False
        return True

    async def _write(self, operation: str, work: Callable[[], Awaitable[object]]) -> None:
        await self.write(operation, work)

    async def _ping_once(self) -> None:
        # redis-py types its commands for both clients (`Awaitable[bool] | bool`).
        reply = self.client.ping()
        if inspect.isawaitable(reply):
            await reply

    async def _ping(self, timeout: float | None = None) -> bool:
        try:
            async with asyncio.timeout(timeout or self.timeout):
                await self._ping_once()
                for script in self._scripts:
                    await self.client.script_load(script)
        except _REFUSED as error:
            if not self._refused:
                # Not a Redis that is away: one that will not take this gateway's credentials,
                # which no reconnection will mend.
                log.error("Redis refused the gateway's credentials or commands: %s", error)
            self._refused = True
            return False
        except (RedisError, *_LINK_ERRORS) as error:
            log.debug("Redis PING failed: %s", error)
            return False
        self._refused = False
        self._mark_up()
        return True

    def _mark_up(self) -> None:
        if not self._up:
            if self._reconnecting is not None:
                log.warning("Redis answers again after %.1f s", time.monotonic() - self._down_since)
            self._up = True
            self._metrics.redis_up.set(1)

    def _mark_down(self) -> None:
        # Whatever Redis held may be gone when it answers again (a restart starts empty).
        self._lost_write_at = time.monotonic()
        if self._up:
            self._up = False
            self._down_since = time.monotonic()
            self._metrics.redis_up.set(0)
        if not self._closed and (self._reconnecting is None or self._reconnecting.done()):
            self._reconnecting = asyncio.create_task(self._reconnect())

    async def _reconnect(self) -> None:
        delay, ceiling = self._backoff
        while not self._closed:
            # Jitter keeps a fleet of gateways from probing a recovering Redis in lockstep.
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            if await self._ping():
                return
            delay = min(delay * 2, ceiling)
