"""KV-event feeds against a stand-in for vLLM's publisher: an HTTP server answering
`/kv_event_sources` as vLLM 0.32 does and a ZeroMQ PUB socket sending the recorded sample's
frames (tests/data/vllm_kv_events.msgpack) exactly as received from a real replica."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import zmq

from engines.kv_events import load_sample
from prefix_gateway.backends.kv_events import FeedState, KVEventFeeds, sources, subscribe_address
from prefix_gateway.backends.pool import BackendPool
from prefix_gateway.metrics import Metrics
from tests.support import PATIENCE_SECONDS, eventually

SAMPLE = Path(__file__).parent / "data" / "vllm_kv_events.msgpack"


class Publisher:
    """vLLM's side: its event-source answer on HTTP, its PUB socket on ipc."""

    def __init__(self, folder: Path) -> None:
        self.endpoint = f"ipc://{folder}/events.sock"
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.PUB)
        self.socket.bind(self.endpoint)
        publisher = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                answer = publisher.answer()
                found = self.path == "/kv_event_sources"
                self.send_response(200 if found else 404)
                self.send_header("content-length", str(len(answer) if found else 0))
                self.end_headers()
                if found:
                    self.wfile.write(answer)

            def log_message(self, *args: object) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()

    def answer(self) -> bytes:
        endpoint = self.endpoint
        if endpoint.startswith("tcp://127.0.0.1:"):
            endpoint = "tcp://*:" + endpoint.rpartition(":")[2]  # bound as vLLM binds
        source = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": endpoint,
            "topic": "kv-events",
        }
        return json.dumps({"0": source}).encode()

    def restart(self, endpoint: str | None = None) -> None:
        """The engine goes away and comes back, at `endpoint` or where it was."""
        self.socket.close(0)
        self.socket = self.context.socket(zmq.PUB)
        self.socket.bind(endpoint or self.endpoint)
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def stop(self) -> None:
        self.socket.close(0)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http.server_address[1]}"

    def send(self, frames: list[tuple[bytes, int, bytes]]) -> None:
        for topic, seq, payload in frames:
            self.socket.send_multipart([topic, seq.to_bytes(8, "big"), payload])

    def close(self) -> None:
        self.socket.close(0)
        self.context.term()
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def publisher(tmp_path: Path) -> Iterator[Publisher]:
    publisher = Publisher(tmp_path)
    yield publisher
    publisher.close()


def test_sources_and_where_to_connect() -> None:
    answer = {
        "0": {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": "tcp://*:5557",
            "topic": "kv-events",
        }
    }
    assert sources(answer) == [("tcp://*:5557", "kv-events")]
    assert sources({}) == []
    assert subscribe_address("tcp://*:5557", "http://10.0.0.7:8000") == "tcp://10.0.0.7:5557"
    assert subscribe_address("tcp://10.0.0.9:5557", "http://10.0.0.7:8000") == "tcp://10.0.0.9:5557"
    assert subscribe_address("ipc:///tmp/e.sock", "http://10.0.0.7:8000") == "ipc:///tmp/e.sock"


def test_a_feed_follows_the_publisher_then_falls_back_when_it_goes(
    publisher: Publisher,
) -> None:
    frames = load_sample(SAMPLE)

    async def scenario() -> None:
        pool = BackendPool.from_specs((publisher.url,))
        name = pool.backends[0].name
        metrics = Metrics()
        stored: list[int] = []
        async with httpx.AsyncClient(timeout=PATIENCE_SECONDS) as client:
            feeds = KVEventFeeds(
                pool, client, 32, metrics, lambda _, blocks: stored.extend(blocks), interval=0.1
            )
            feeds.start()
            try:
                await eventually(lambda: name in feeds.live(), "the feed is live")
                # The subscription takes a moment to reach the publisher: send until heard.
                for _ in range(50):
                    publisher.send(frames[:1])
                    await asyncio.sleep(0.1)
                    if stored:
                        break
                assert stored, "the first stored blocks were heard"

                def sample(series: str, **labels: str) -> float | None:
                    return metrics.registry.get_sample_value(series, {"backend": name, **labels})

                received = sample("gateway_kv_events_messages_total")
                assert received is not None
                publisher.send(
                    [(topic, seq + 1000, payload) for topic, seq, payload in frames[1:2]]
                )
                await eventually(lambda: name not in feeds.live(), "a skipped sequence number")
                assert sample("gateway_kv_events_fallbacks_total", reason="missed") == 1
                assert sample("gateway_kv_events_messages_total") == received + 1
                assert sample("gateway_kv_events_live") == 0
            finally:
                await feeds.stop()

    asyncio.run(scenario())


def test_a_restarted_publisher_is_followed_afresh_on_its_port_then_on_a_new_one(
    publisher: Publisher,
) -> None:
    frames = load_sample(SAMPLE)

    async def scenario() -> None:
        pool = BackendPool.from_specs((publisher.url,))
        name = pool.backends[0].name
        metrics = Metrics()
        stored: list[int] = []
        async with httpx.AsyncClient(timeout=PATIENCE_SECONDS) as client:
            feeds = KVEventFeeds(
                pool, client, 32, metrics, lambda _, blocks: stored.extend(blocks), interval=0.1
            )

            def state() -> FeedState:
                found = feeds.state(name)
                assert found is not None
                return found

            async def heard(sequence: int) -> None:
                """Send the sample's first frame numbered `sequence` until it is heard."""
                before = len(stored)
                for _ in range(100):
                    publisher.send([(frames[0][0], sequence, frames[0][2])])
                    await asyncio.sleep(0.05)
                    if len(stored) > before:
                        return
                raise AssertionError(f"message {sequence} never heard")

            feeds.start()
            try:
                await eventually(lambda: name in feeds.live(), "the feed is live")
                for sequence in range(3):
                    await heard(sequence)
                assert state().last_sequence == 2 and state().blocks > 0

                # Killed, then back on the same endpoint numbering from 0.
                publisher.stop()
                await eventually(lambda: not state().connected, "the disconnect is seen")
                assert name not in feeds.live()
                publisher.restart()
                await eventually(lambda: name in feeds.live(), "live again on the same endpoint")
                assert state().blocks == 0, "what the old engine held is forgotten"
                await heard(0)
                assert state().last_sequence == 0 and state().blocks > 0
                assert name in feeds.live()

                # Killed, then back on another port: its sources are read again.
                first = state().endpoint
                publisher.stop()
                await eventually(lambda: not state().connected, "the second disconnect is seen")
                publisher.restart("tcp://127.0.0.1:0")
                await eventually(
                    lambda: state().endpoint == publisher.endpoint and name in feeds.live(),
                    "live again on the new port",
                )
                assert state().endpoint != first
                await heard(0)
                assert state().last_sequence == 0 and name in feeds.live()
                assert state().messages >= 5
                fallbacks = metrics.registry.get_sample_value(
                    "gateway_kv_events_fallbacks_total", {"backend": name, "reason": "disconnected"}
                )
                assert fallbacks == 2
                live = metrics.registry.get_sample_value(
                    "gateway_kv_events_live", {"backend": name}
                )
                assert live == 1
            finally:
                await feeds.stop()

    asyncio.run(scenario())
