"""Clients that hang up as soon as they read `data: [DONE]`, as the official sync client does:
the usage their replica sent before it is still counted, every time — also when the client's
hang-up reaches the gateway before the end of the replica's response does."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import orjson

from prefix_gateway.emulator.replicas import EmulatedReplicas
from tests.support import GatewayProcess, metric_value, wait_until
from tests.threaded_server import ThreadedServer

MODEL = "emulated-model"
STREAMS = 48
SHARED = "You answer questions about the harbour, its ships and their cargo. " * 8


async def _stream_until_done(client: httpx.AsyncClient, turn: int) -> tuple[int, int]:
    """The usage the client saw; the connection is closed right after `[DONE]`."""
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": SHARED},
            {"role": "user", "content": f"which ship came in {turn}?"},
        ],
        "max_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage: dict[str, object] = {}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                break  # leaving the block closes the connection: nothing more is read
            if line.startswith("data: ") and '"usage"' in line:
                found = orjson.loads(line[6:]).get("usage")
                if found:
                    usage = found
    assert usage, "the replica sent its usage before [DONE]"
    details = usage.get("prompt_tokens_details") or {}
    assert isinstance(details, dict)
    prompt = usage["prompt_tokens"]
    assert isinstance(prompt, int)
    return prompt, int(details.get("cached_tokens") or 0)


async def _clients(url: str) -> list[tuple[int, int]]:
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
        first = [await _stream_until_done(client, 0)]  # the shared prefix cached from here
        rest = await asyncio.gather(*(_stream_until_done(client, t) for t in range(1, STREAMS)))
        return first + list(rest)


def test_usage_before_done_is_counted_when_the_client_hangs_up_at_done() -> None:
    with (
        EmulatedReplicas(2, MODEL) as fleet,
        GatewayProcess(fleet.urls) as gateway,
    ):
        seen = asyncio.run(_clients(gateway.url))
        prompt = sum(tokens for tokens, _ in seen)
        cached = sum(tokens for _, tokens in seen)
        assert cached > 0

        def counted() -> tuple[float, float]:
            text = gateway.metrics()
            return (
                metric_value(text, "gateway_upstream_prompt_tokens_total"),
                metric_value(text, "gateway_upstream_cached_tokens_total"),
            )

        wait_until(lambda: counted() == (prompt, cached), f"{prompt}, {cached} counted")
        assert not gateway.tracebacks() and not fleet.tracebacks()


_USAGE = {
    "prompt_tokens": 321,
    "completion_tokens": 2,
    "total_tokens": 323,
    "prompt_tokens_details": {"cached_tokens": 288},
}


class LingeringReplica(ThreadedServer):
    """Streams two deltas, its usage and `[DONE]`, then keeps the response open (the end of
    its chunked body unsent) until the gateway hangs up: the client's hang-up at `[DONE]` is
    certain to reach the gateway first."""

    def __init__(self) -> None:
        super().__init__()
        self.hung_up = threading.Event()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async for _ in self.posts(reader, writer):
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n"
                )
                for text in ("Two", " ships"):
                    delta = {"choices": [{"index": 0, "delta": {"content": text}}]}
                    self._event(writer, json.dumps(delta).encode())
                self._event(writer, json.dumps({"choices": [], "usage": _USAGE}).encode())
                self._event(writer, b"[DONE]")
                await writer.drain()
                await reader.read()  # until the gateway closes the connection
                self.hung_up.set()
                return
        finally:
            writer.close()

    @staticmethod
    def _event(writer: asyncio.StreamWriter, payload: bytes) -> None:
        event = b"data: " + payload + b"\n\n"
        writer.write(b"%x\r\n%s\r\n" % (len(event), event))


def test_usage_is_counted_when_the_hang_up_comes_before_the_replicas_end() -> None:
    with LingeringReplica() as replica, GatewayProcess([f"{MODEL}={replica.url}"]) as gateway:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "which ships came in?"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with (
            httpx.Client(base_url=gateway.url, timeout=30) as client,
            client.stream("POST", "/v1/chat/completions", json=body) as response,
        ):
            assert response.status_code == 200
            lines = []
            for line in response.iter_lines():
                lines.append(line)
                if line == "data: [DONE]":
                    break
        assert any('"usage"' in line for line in lines)
        assert replica.hung_up.wait(30), "the gateway ended the replica's request"

        def counted() -> tuple[float, float, float]:
            text = gateway.metrics()
            return (
                metric_value(text, "gateway_requests_total", status="200"),
                metric_value(text, "gateway_upstream_prompt_tokens_total"),
                metric_value(text, "gateway_upstream_cached_tokens_total"),
            )

        expected = (1, _USAGE["prompt_tokens"], 288)
        wait_until(lambda: counted() == expected, f"{expected} counted, not {counted()}")
