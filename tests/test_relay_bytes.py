"""The client receives exactly the bytes its replica sent: answers and streams of a real emulated
replica, recorded on the wire between the gateway and the replica by a relaying socket."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from prefix_gateway.emulator.replicas import EmulatedReplicas
from tests.conftest import MODEL
from tests.support import GatewayProcess, wait_until
from tests.threaded_server import ThreadedServer
from tests.words import words


class RecordingRelay(ThreadedServer):
    """A loopback port that relays every connection to `target` and keeps what came back."""

    def __init__(self, target_host: str, target_port: int) -> None:
        super().__init__()
        self._target = (target_host, target_port)
        self.received: list[bytearray] = []
        """Per connection, every byte the target sent."""

    async def _handle(self, client: asyncio.StreamReader, to_client: asyncio.StreamWriter) -> None:
        target, to_target = await asyncio.open_connection(*self._target)
        record = bytearray()
        self.received.append(record)

        async def pipe(
            source: asyncio.StreamReader, sink: asyncio.StreamWriter, kept: bytearray | None
        ) -> None:
            while data := await source.read(65536):
                if kept is not None:
                    kept += data
                sink.write(data)
                await sink.drain()
            sink.close()

        try:
            await asyncio.gather(pipe(client, to_target, None), pipe(target, to_client, record))
        except (ConnectionError, OSError):
            pass
        finally:
            for writer in (to_target, to_client):
                writer.close()


def bodies(wire: bytes) -> Iterator[bytes]:
    """The bodies of the HTTP/1.1 responses in `wire`, framing removed (Content-Length or
    chunked); a response still incomplete at the end is left out."""
    position = 0
    while (end := wire.find(b"\r\n\r\n", position)) >= 0:
        head = wire[position:end].decode("latin-1").lower().split("\r\n")
        fields = dict(line.split(": ", 1) for line in head[1:])
        position = end + 4
        if "content-length" in fields:
            length = int(fields["content-length"])
            if position + length > len(wire):
                return
            yield wire[position : position + length]
            position += length
            continue
        body = bytearray()
        while True:
            line_end = wire.find(b"\r\n", position)
            if line_end < 0:
                return
            size = int(wire[position:line_end].split(b";")[0], 16)
            position = line_end + 2
            if size == 0:
                position += 2
                break
            body += wire[position : position + size]
            position += size + 2
        yield bytes(body)


@pytest.fixture(scope="module")
def relay() -> Iterator[tuple[RecordingRelay, GatewayProcess]]:
    with EmulatedReplicas(1, MODEL, ["--decode-ms-per-token", "2"]) as single:
        replica = single.replicas[0]
        with (
            RecordingRelay(replica.host, replica.port) as recording,
            GatewayProcess([recording.url]) as gateway,
        ):
            wait_until(
                lambda: gateway.metric("gateway_backend_healthy") == 1, "the replica healthy"
            )
            yield recording, gateway


def sent_by_the_replica(recording: RecordingRelay) -> list[bytes]:
    return [body for wire in recording.received for body in bodies(bytes(wire))]


@pytest.mark.parametrize("endpoint", ["chat/completions", "completions"])
def test_an_answer_reaches_the_client_byte_for_byte(
    relay: tuple[RecordingRelay, GatewayProcess], endpoint: str
) -> None:
    recording, gateway = relay
    request: dict[str, object] = {"model": MODEL, "max_tokens": 40}
    if endpoint == "completions":
        request["prompt"] = words(50)
    else:
        request["messages"] = [{"role": "user", "content": words(50)}]
    answer = httpx.post(f"{gateway.url}/v1/{endpoint}", json=request, timeout=30)
    assert answer.status_code == 200
    assert b'"choices"' in answer.content
    assert answer.headers["content-length"] == str(len(answer.content))
    assert answer.content in sent_by_the_replica(recording)


@pytest.mark.parametrize("usage", [False, True])
def test_a_stream_reaches_the_client_byte_for_byte(
    relay: tuple[RecordingRelay, GatewayProcess], usage: bool
) -> None:
    recording, gateway = relay
    request: dict[str, object] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": words(50)}],
        "max_tokens": 60,
        "stream": True,
    }
    if usage:
        request["stream_options"] = {"include_usage": True}
    received = bytearray()
    with httpx.stream(
        "POST", gateway.url + "/v1/chat/completions", json=request, timeout=30
    ) as response:
        for chunk in response.iter_raw():
            received += chunk
    assert received.count(b"data: ") == 60 + usage + 1  # tokens, usage, [DONE]
    assert received.endswith(b"data: [DONE]\n\n")
    assert bytes(received) in sent_by_the_replica(recording)
