"""A bounded load client for fault scenarios, and the tally of what every request got.

Each request ends in exactly one of three ways:

- *ok*: a complete answer (a JSON body, or a stream that ends with `data: [DONE]`);
- *failed*: a clean error the client can act on: an HTTP error status with a JSON error body,
  or a stream whose last event is `data: {"error": ...}`;
- *lost*: anything else — a connection dropped or reset, a truncated stream, no answer in
  time. A gateway must lose none.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

MODEL = "emulated-model"
CLIENT_TIMEOUT = 30.0


@dataclass
class Tally:
    sent: int = 0
    ok: int = 0
    failed: int = 0
    lost: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    failed_streams: int = 0
    """Streams that began (status 200) and then ended with an SSE error event."""
    failed_plain: int = 0
    """Non-streamed requests answered with an error status."""
    backends: Counter[str] = field(default_factory=Counter)
    """Which backend answered (x-gateway-backend) the requests that were ok."""
    retry_after: int = 0
    """Error answers that carried a Retry-After header."""
    streaming: Counter[str] = field(default_factory=Counter)
    """Streams under way now, by the backend relaying them."""
    lost_reasons: list[str] = field(default_factory=list)

    def merge(self, other: Tally) -> None:
        self.sent += other.sent
        self.ok += other.ok
        self.failed += other.failed
        self.lost += other.lost
        self.statuses.update(other.statuses)
        self.failed_streams += other.failed_streams
        self.failed_plain += other.failed_plain
        self.backends.update(other.backends)
        self.retry_after += other.retry_after
        self.lost_reasons.extend(other.lost_reasons)


@dataclass
class Result:
    scenario: str
    tally: Tally
    faults: str
    """What was injected, in words with counts."""
    facts: dict[str, float] = field(default_factory=dict)


def chat_body(tag: str, stream: bool, max_tokens: int = 8, words: int = 40) -> dict[str, object]:
    prompt = " ".join(f"{tag}w{index}" for index in range(words))
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


async def one_request(
    client: httpx.AsyncClient, url: str, body: dict[str, object], tally: Tally
) -> None:
    """Send one chat request and record how it ended."""
    tally.sent += 1
    stream = bool(body.get("stream"))
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            tally.statuses[response.status_code] += 1
            if response.status_code != 200:
                payload = await response.aread()
                if "retry-after" in response.headers:
                    tally.retry_after += 1
                if _is_error(payload):
                    tally.failed += 1
                    tally.failed_plain += 1
                else:
                    _lose(tally, f"status {response.status_code} without an error body")
                return
            backend = response.headers.get("x-gateway-backend", "")
            if not stream:
                json.loads(await response.aread())
                tally.ok += 1
                tally.backends[backend] += 1
                return
            last = ""
            tally.streaming[backend] += 1
            try:
                async for line in response.aiter_lines():
                    if line.startswith("data:"):
                        last = line[5:].strip()
            finally:
                tally.streaming[backend] -= 1
            if last == "[DONE]":
                tally.ok += 1
                tally.backends[backend] += 1
            elif _is_error(last.encode()):
                tally.failed += 1
                tally.failed_streams += 1
            else:
                _lose(tally, f"stream ended after {last[:60]!r}")
    except (httpx.HTTPError, ValueError) as error:
        _lose(tally, repr(error))


async def run_load(
    url: str,
    workers: int,
    stop: asyncio.Event,
    tally: Tally,
    stream_every: int = 2,
    max_tokens: int = 8,
    tag: str = "load",
) -> None:
    """`workers` clients sending back to back until `stop` is set; every `stream_every`-th
    request is streamed."""
    serial = itertools.count()
    limits = httpx.Limits(max_connections=workers, max_keepalive_connections=workers)
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT, limits=limits) as client:

        async def worker() -> None:
            while not stop.is_set():
                number = next(serial)
                stream = stream_every > 0 and number % stream_every == 0
                body = chat_body(f"{tag}{number}", stream, max_tokens)
                await one_request(client, url, body, tally)

        await asyncio.gather(*(worker() for _ in range(workers)))


async def burst(url: str, count: int, tally: Tally, max_tokens: int = 8, tag: str = "b") -> None:
    """`count` requests at once, each on a connection of its own."""
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT, limits=limits) as client:
        await asyncio.gather(
            *(
                one_request(client, url, chat_body(f"{tag}{index}", False, max_tokens), tally)
                for index in range(count)
            )
        )


async def wait_for(check: Callable[[], object], seconds: float, every: float = 0.05) -> bool:
    """Poll `check()` (sync, run in a thread) until true or `seconds` pass."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if await asyncio.to_thread(check):
            return True
        await asyncio.sleep(every)
    return False


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _is_error(payload: bytes) -> bool:
    try:
        data = json.loads(payload)
    except ValueError:
        return False
    return isinstance(data, dict) and isinstance(data.get("error"), dict)


def _lose(tally: Tally, reason: str) -> None:
    tally.lost += 1
    if len(tally.lost_reasons) < 20:
        tally.lost_reasons.append(reason)
