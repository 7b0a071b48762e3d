"""Attacks on the request edge: what each costs the gateway, and whether it keeps serving.

Two emulated replicas for the whole run and, for each attack, a fresh gateway with default
settings in front of them (a memory peak is only honest on a fresh process). While an attack
runs, a separate process polls `/health` and sends normal requests. One table row per attack:
the gateway's peak resident memory above where it stood before (VmHWM, reset before the
attack, less VmRSS), the longest `/health` round trip, and how many normal requests succeeded.

    python loadtest/attacks.py
    python loadtest/attacks.py --attacks header_flood,slow_heads
    python loadtest/attacks.py --parse-cost   # CPU of parsing the largest bodies, in process

An attack is an `Attack` in `ATTACKS`: a name, the words for what it sends, and a coroutine
that runs it against the gateway and says what the gateway answered. One with no coroutine
is a row still to be measured.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtest.attack_bodies import DEFAULTS, arrays_then_strings, messages, parse_cost, strings
from loadtest.attack_harness import MODEL, Attack, Target, measure
from loadtest.large_replies import (
    large_chat,
    large_embeddings,
    large_reply_replica,
    unread_replies,
)
from loadtest.slow_readers import slow_readers
from prefix_gateway.emulator.replicas import EmulatedReplicas

MIB = 2**20
LIMIT = f"{DEFAULTS.max_body_bytes / MIB:g} MiB"


# --- the attacks ---------------------------------------------------------------------------


async def _post(target: Target, body: bytes) -> int:
    reader, writer = await asyncio.open_connection(target.host, target.port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
    )
    writer.write(body)
    await writer.drain()
    answer = await reader.read()
    writer.close()
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0


def _largest_body(make: Callable[[], bytes]) -> Callable[[Target], Awaitable[str]]:
    async def run(target: Target) -> str:
        body = make()
        statuses = Counter([await _post(target, body) for _ in range(3)])
        return _tally(statuses)

    return run


async def _stream_header_line(target: Target) -> tuple[str, int]:
    """A 64 MiB header line in 64 KiB pieces, until the gateway answers or closes."""
    reader, writer = await asyncio.open_connection(target.host, target.port)
    answer = asyncio.create_task(reader.read(64))
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-padding: ")
    piece, sent = b"b" * 65536, 0
    try:
        while sent < 64 * MIB and not answer.done():
            writer.write(piece)
            await writer.drain()
            sent += len(piece)
    except ConnectionError:
        pass
    try:
        head = await asyncio.wait_for(answer, 10)
    except (TimeoutError, ConnectionError):
        head = b""
    writer.close()
    return _status_of(head), sent


async def header_flood(target: Target) -> str:
    statuses: Counter[str] = Counter()
    sent: list[int] = []
    ends = time.monotonic() + 5

    async def one_client() -> None:
        while time.monotonic() < ends:
            status, count = await _stream_header_line(target)
            statuses[status] += 1
            sent.append(count)

    await asyncio.gather(*(one_client() for _ in range(32)))
    return f"{_tally(statuses)}; at most {max(sent) / MIB:.1f} MiB sent on one connection"


async def _hold(
    target: Target, first: bytes, drip: bytes, every: float, seconds: float, source: str = ""
) -> str:
    """Send `first`, then `drip` every `every` seconds for `seconds`, from the address `source`
    (any if empty); what the gateway said."""
    local = (source, 0) if source else None
    try:
        reader, writer = await asyncio.open_connection(target.host, target.port, local_addr=local)
    except OSError:
        return "not connected"
    answer = asyncio.create_task(reader.read(4096))
    writer.write(first)
    ends = time.monotonic() + seconds
    try:
        while time.monotonic() < ends and not answer.done():
            await asyncio.sleep(every)
            writer.write(drip)
            await writer.drain()
    except ConnectionError:
        pass
    if not answer.done():
        answer.cancel()
        writer.close()
        return "still open"
    writer.close()
    try:
        head = answer.result()
    except ConnectionError:
        return "reset"
    return _status_of(head)


async def slow_heads(target: Target) -> str:
    first = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-slow: "
    seconds = DEFAULTS.head_timeout + 3
    results = await asyncio.gather(*(_hold(target, first, b"s", 1.0, seconds) for _ in range(2000)))
    return _tally(Counter(results))


async def slow_bodies(target: Target) -> str:
    first = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b'content-length: %d\r\n\r\n{"model":' % DEFAULTS.max_body_bytes
    )
    results = await asyncio.gather(*(_hold(target, first, b" ", 1.0, 8) for _ in range(500)))
    return _tally(Counter(results))


async def bodies_filling_the_budget(target: Target) -> str:
    size = DEFAULTS.max_body_bytes - MIB
    first = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % DEFAULTS.max_body_bytes
    ) + b" " * size
    results = await asyncio.gather(*(_hold(target, first, b" ", 1.0, 6) for _ in range(48)))
    return _tally(Counter(results))


async def held_connections(target: Target) -> str:
    """Each answered before its body (405), then sent more of it: held, before, with uvicorn's
    keep-alive timer stopped. From 127.0.0.2, an address of its own beside the watcher's."""
    first = (
        b"PUT /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b'content-length: %d\r\n\r\n{"model":' % DEFAULTS.max_body_bytes
    )
    held = (_hold(target, first, b" ", 1.0, 8, source="127.0.0.2") for _ in range(4100))
    return _tally(Counter(await asyncio.gather(*held)))


async def _request(target: Target, head: bytes, body: bytes) -> str:
    """The status the gateway answered (`reset` if it closed before answering)."""
    reader, writer = await asyncio.open_connection(target.host, target.port)
    try:
        writer.write(head + b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body))
        writer.write(body)
        await writer.drain()
    except ConnectionError:
        pass  # refused before the body was in: its answer may still be there to read
    try:
        answer = await reader.read(64)
    except ConnectionError:
        answer = b""
    writer.close()
    return _status_of(answer)


async def session_key_flood(target: Target) -> str:
    body = orjson.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    )
    keys = iter(range(20_000))
    statuses = Counter[str]()

    async def worker() -> None:
        for number in keys:
            key = f"{number:08d}".encode() * 64  # 512 characters, every one distinct
            head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-session-id: " + key
            statuses[await _request(target, head + b"\r\n", body)] += 1

    await asyncio.gather(*(worker() for _ in range(32)))
    huge = "k" * (20 * MIB)
    for _ in range(6):
        keyed = orjson.dumps({"model": MODEL, "messages": [], "prompt_cache_key": huge})
        plain = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
        statuses[await _request(target, plain, keyed)] += 1
    return _tally(statuses)


async def long_prompts(target: Target) -> str:
    words = " ".join(f"w{index % 9973}" for index in range(DEFAULTS.max_prompt_tokens))
    statuses = Counter[str]()
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
    for number in range(4):
        body = orjson.dumps({"model": MODEL, "prompt": f"{number} {words}", "max_tokens": 1})
        statuses[await _request(target, head, body)] += 1
    filler = b"x " * (DEFAULTS.max_body_bytes // 2 - 64)
    for _ in range(3):
        body = b'{"model":"' + MODEL.encode() + b'","max_tokens":1,"prompt":"' + filler + b'"}'
        statuses[await _request(target, head, body)] += 1
    return _tally(statuses)


ATTACKS = [
    Attack("none", "normal requests only", None),
    Attack(
        "largest_body_arrays",
        f"3 bodies of {LIMIT}, {DEFAULTS.max_json_values:,} values:"
        f" {DEFAULTS.max_json_values // 4:,} `[]`, then strings",
        _largest_body(arrays_then_strings),
    ),
    Attack(
        "largest_body_strings",
        f"3 bodies of {LIMIT}, {DEFAULTS.max_json_values:,} string values",
        _largest_body(strings),
    ),
    Attack(
        "largest_body_messages",
        f"3 bodies of {LIMIT}: {DEFAULTS.max_messages:,} messages",
        _largest_body(messages),
    ),
    Attack("header_flood", "32 clients streaming 64 MiB header lines, for 5 s", header_flood),
    Attack(
        "slow_heads",
        f"2,000 heads, a byte a second, for {DEFAULTS.head_timeout + 3:g} s",
        slow_heads,
    ),
    Attack("slow_bodies", "500 bodies, a byte a second, for 8 s", slow_bodies),
    Attack(
        "bodies_filling_the_budget",
        f"48 bodies sending {(DEFAULTS.max_body_bytes - MIB) / MIB:g} MiB, then a byte a second",
        bodies_filling_the_budget,
    ),
    Attack(
        "held_connections",
        "4,100 connections from one address, each answered before its body (405), then a body"
        " byte a second, for 8 s",
        held_connections,
    ),
    Attack(
        "session_key_flood",
        "20,000 requests with 20,000 session keys of 512 characters; 6 keys of 20 MiB",
        session_key_flood,
    ),
    Attack(
        "long_prompt_redis",
        f"with Redis: 4 prompts at the hashing cap ({DEFAULTS.max_prompt_tokens:,} tokens),"
        f" 3 of {LIMIT}",
        long_prompts,
        with_redis=True,
    ),
    Attack(
        "slow_readers",
        f"6 streams of 40,000 tokens, a 4 KiB receive buffer, never read"
        f" (`--client-write-timeout` {DEFAULTS.client_write_timeout:g} s)",
        lambda target: slow_readers(target.host, target.port),
    ),
    Attack(
        "large_reply",
        "non-streamed chat answers of 300 MB, one after the other for 8 s",
        lambda target: large_chat(target.host, target.port),
        replica=large_reply_replica,
    ),
    Attack(
        "large_embeddings_reply",
        "embeddings answers of 2,048 inputs × 4,096 floats (96 MiB, chunked),"
        " one after the other for 8 s",
        lambda target: large_embeddings(target.host, target.port),
        replica=large_reply_replica,
    ),
    Attack(
        "unread_replies",
        "4 clients asking for 50 MB answers, reading none of them for 10 s",
        lambda target: unread_replies(target.host, target.port),
        replica=large_reply_replica,
    ),
]


MEASURED_EMPTY = {"none"}
"""Rows measured with no attack at all: the baseline of the others."""


def _status_of(head: bytes) -> str:
    return head.split(b" ", 2)[1].decode() if head.startswith(b"HTTP/1.1 ") else "reset"


def _tally(counts: Counter[str] | Counter[int]) -> str:
    return ", ".join(f"{key} ×{count:,}" for key, count in sorted(counts.items(), key=str))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attacks", default=",".join(attack.name for attack in ATTACKS))
    parser.add_argument(
        "--parse-cost",
        action="store_true",
        help="only print the CPU time one parse of each largest body holds the event loop",
    )
    options = parser.parse_args()
    if options.parse_cost:
        parse_cost()
        return
    chosen = options.attacks.split(",")
    unknown = set(chosen) - {attack.name for attack in ATTACKS}
    if unknown:
        parser.error(f"unknown attacks: {', '.join(sorted(unknown))}")
    print(
        "| attack | sent | gateway answered | peak RSS growth | longest /health"
        " | longest Redis PING | normal requests ok |"
    )
    print("|---|---|---|---|---|---|---|")
    # Caches large enough that a prompt at the hashing cap is accepted (and then shared).
    cache = str(2 * DEFAULTS.max_prompt_tokens // 16)
    with EmulatedReplicas(2, MODEL, ["--cache-blocks", cache]) as fleet:
        for attack in ATTACKS:
            if attack.name not in chosen:
                continue
            if attack.run is None and attack.name not in MEASURED_EMPTY:
                print(f"| {attack.name} | {attack.sends} | — | — | — | — | — |", flush=True)
                continue
            print(await measure(attack, fleet.urls), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
