"""Each replica's KV-cache events (`--kv-events`): where its engine publishes them is read from
its `GET /kv_event_sources` (vLLM's ZeroMQ publisher: endpoint and topic per data-parallel
rank), then a SUB socket there feeds the replica's `EngineBlocks`.

A replica's events count as flowing while its socket is connected and no message was missed;
when they stop (the publisher went away, a sequence number skipped), the router goes back to
the predicted index for it, and `gateway_kv_events_fallbacks_total` says why. A replica that
answers no source is tried again every `interval` seconds.

When the socket connects again, what the engine did meanwhile was not heard (it may have
restarted with an empty cache, or evicted blocks): its blocks are known afresh from the next
event, and the feed counts again at once. A feed down for `interval` seconds asks the replica
for its sources again, so an engine restarted on a new event port is followed there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import msgpack
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from prefix_gateway.backends.pool import BackendPool
from prefix_gateway.metrics import Metrics
from prefix_gateway.state.engine_blocks import EngineBlocks

log = logging.getLogger("prefix_gateway.backends.kv_events")

_ANY_HOST = ("*", "0.0.0.0", "[::]", "::")


def subscribe_address(endpoint: str, replica_url: str) -> str:
    """Where to connect for a publisher bound at `endpoint`: a wildcard host is the replica's."""
    if not endpoint.startswith("tcp://"):
        return endpoint  # ipc:// (same machine) and the rest connect as given
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    if host in _ANY_HOST:
        replica_host = urlsplit(replica_url).hostname or "127.0.0.1"
        host = f"[{replica_host}]" if ":" in replica_host else replica_host
    return f"tcp://{host}:{port}"


def sources(answer: Any) -> list[tuple[str, str]]:
    """(endpoint, topic) of every rank whose publisher is the ZeroMQ one, from
    `/kv_event_sources`."""
    found = []
    if isinstance(answer, dict):
        for config in answer.values():
            if not isinstance(config, dict) or not config.get("enable_kv_cache_events"):
                continue
            endpoint = config.get("endpoint")
            if config.get("publisher") == "zmq" and isinstance(endpoint, str):
                found.append((endpoint, str(config.get("topic") or "")))
    return found


@dataclass(frozen=True)
class FeedState:
    """A feed as `/admin/backends` shows it."""

    live: bool
    connected: bool
    endpoint: str
    topic: str
    last_sequence: int | None
    messages: int
    blocks: int


@dataclass(eq=False)
class _Feed:
    blocks: EngineBlocks
    address: str = ""
    topic: str = ""
    task: asyncio.Task[None] | None = None
    connected: bool = False
    live: bool = False
    was_connected: bool = False
    down_since: float = 0.0
    """When the socket last lost (or began without) its publisher, on the loop's clock."""
    messages: int = 0


class KVEventFeeds:
    """The event feeds of the pool's replicas; `live()` those whose events flow."""

    def __init__(
        self,
        pool: BackendPool,
        client: httpx.AsyncClient,
        block_size: int,
        metrics: Metrics,
        on_stored: Callable[[str, Iterable[int]], None],
        interval: float = 5.0,
    ) -> None:
        self._pool = pool
        self._client = client
        self._block_size = block_size
        self._metrics = metrics
        self._on_stored = on_stored
        self._interval = interval
        self._context = zmq.asyncio.Context()
        self._feeds: dict[str, _Feed] = {}
        self._task: asyncio.Task[None] | None = None

    def live(self) -> dict[str, EngineBlocks]:
        return {name: feed.blocks for name, feed in self._feeds.items() if feed.live}

    def state(self, name: str) -> FeedState | None:
        feed = self._feeds.get(name)
        if feed is None:
            return None
        return FeedState(
            live=feed.live,
            connected=feed.connected,
            endpoint=feed.address,
            topic=feed.topic,
            last_sequence=feed.blocks.last_sequence,
            messages=feed.messages,
            blocks=len(feed.blocks),
        )

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kv-event-feeds")

    async def stop(self) -> None:
        tasks = [self._task, *(feed.task for feed in self._feeds.values())]
        for task in tasks:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._feeds.clear()
        self._context.term()

    def forget(self, name: str) -> None:
        """`name` left the pool: its feed ends."""
        feed = self._feeds.pop(name, None)
        if feed is not None and feed.task is not None:
            feed.task.cancel()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            for backend in list(self._pool.backends):
                feed = self._feeds.get(backend.name)
                if feed is None or feed.task is None or feed.task.done():
                    await self._open(backend.name, backend.url)
                elif not feed.connected and loop.time() - feed.down_since >= self._interval:
                    # Its engine may have come back on another port (`tcp://*:0`).
                    await self._open(backend.name, backend.url)
            await asyncio.sleep(self._interval)

    async def _open(self, name: str, url: str) -> None:
        try:
            response = await self._client.get(url + "/kv_event_sources")
            found = sources(response.json()) if response.status_code == 200 else []
        except (httpx.HTTPError, ValueError):
            found = []
        if not found:
            return
        endpoint, topic = found[0]  # one engine per replica (data-parallel rank 0)
        address = subscribe_address(endpoint, url)
        feed = self._feeds.get(name)
        if feed is not None and feed.task is not None and not feed.task.done():
            if (feed.address, feed.topic) == (address, topic):
                return  # the socket reconnects there by itself
            feed.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await feed.task
        if self._feeds.get(name) is not feed:
            return  # left the pool meanwhile
        if feed is None:
            feed = _Feed(EngineBlocks(self._block_size))
            self._feeds[name] = feed
        else:
            feed.blocks = EngineBlocks(self._block_size)  # another publisher: nothing known
        feed.address, feed.topic = address, topic
        feed.connected = feed.was_connected = False
        feed.down_since = asyncio.get_running_loop().time()
        feed.task = asyncio.create_task(self._follow(name, feed, address, topic))

    async def _follow(self, name: str, feed: _Feed, address: str, topic: str) -> None:
        socket = self._context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt_string(zmq.SUBSCRIBE, topic)
        monitor = socket.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED
        )
        socket.connect(address)
        poller = zmq.asyncio.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        received = self._metrics.kv_events.labels(name)
        try:
            while True:
                for ready, _ in await poller.poll():
                    if ready is monitor:
                        self._watch(
                            name, feed, parse_monitor_message(await monitor.recv_multipart())
                        )
                    else:
                        frames = await socket.recv_multipart()
                        received.inc()
                        feed.messages += 1
                        self._receive(name, feed, frames)
        finally:
            self._set_live(name, feed, False, None)
            socket.disable_monitor()
            monitor.close(0)
            socket.close(0)

    def _watch(self, name: str, feed: _Feed, event: Mapping[str, object]) -> None:
        kind = event["event"]
        if kind in (zmq.EVENT_CONNECTED, zmq.EVENT_HANDSHAKE_SUCCEEDED):
            if not feed.connected and feed.was_connected:
                # Back after a gap nothing was heard in: a restarted engine numbers from 0 and
                # holds nothing, one that ran on may have evicted what is known. Start afresh:
                # claiming nothing is safe, and its next events are known exactly.
                feed.blocks = EngineBlocks(self._block_size)
            feed.connected = feed.was_connected = True
            self._set_live(name, feed, feed.blocks.complete, None)
        elif kind == zmq.EVENT_DISCONNECTED:
            if feed.connected:
                feed.down_since = asyncio.get_running_loop().time()
            feed.connected = False
            self._set_live(name, feed, False, "disconnected")

    def _receive(self, name: str, feed: _Feed, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            return
        sequence = int.from_bytes(frames[1], "big", signed=True)
        try:
            batch = msgpack.unpackb(frames[2], raw=False)
            events = batch[1]
        except (ValueError, TypeError, IndexError, msgpack.ExtraData):
            self._metrics.kv_events_undecodable.labels(name).inc()
            return
        if not isinstance(events, list):
            return
        blocks = feed.blocks
        stored = blocks.receive(sequence, [event for event in events if isinstance(event, dict)])
        if stored:
            self._on_stored(name, stored)
        self._set_live(name, feed, feed.connected and blocks.complete, "missed")

    def _set_live(self, name: str, feed: _Feed, live: bool, why: str | None) -> None:
        if feed.live and not live and why is not None:
            self._metrics.kv_events_fallbacks.labels(name, why).inc()
        feed.live = live
        self._metrics.kv_events_live.labels(name).set(1 if live else 0)
