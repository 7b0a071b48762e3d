"""Clients that hang up as soon as they read `data: [DONE]`, as the official sync client does:
the usage their replica sent before it is still counted, every time."""

from __future__ import annotations

import asyncio

import httpx
import orjson

from gateway.emulator.replicas import EmulatedReplicas
from tests.support import GatewayProcess, metric_value, wait_until

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
