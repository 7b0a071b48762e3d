"""Tenants sharing a saturated fleet: what flow control (`--max-inflight-per-replica`) changes.

Two emulated replicas of `--max-running 8` slots each, decoding at `--decode-ms` per token.
Prints two tables:

1. a noisy neighbour: tenant B sends one request at a time (a short question, 16 tokens, a
   pause between); tenant A keeps `--flood` requests in flight (long answers of 64–256
   tokens). B's time to first token (p50, p99) alone, beside A with the gateway's first come,
   first served path (no flow control: the engines' FIFO queues), and beside A under flow
   control (fair queueing, N = the engines' slots). B's client is a process of its own, as a
   second tenant's client is: reading A's streams does not delay the reading of B's;
2. two priority classes under saturation: tenants of priority 1 and 0 each keep `--flood` / 2
   requests in flight under flow control; the median and p90 of their time to first token,
   most of which is their wait for a slot.

    python loadtest/tenants.py
    python loadtest/tenants.py --seconds 60 --flood 128
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prefix_gateway.emulator.replicas import EmulatedReplicas
from tests.support import GatewayProcess

MODEL = "tenants-model"
SLOTS = 8


@contextmanager
def gateway(
    replicas: EmulatedReplicas, tenants: list[dict[str, object]], *args: str
) -> Iterator[GatewayProcess]:
    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "gateway.yaml"
        config.write_text(yaml.safe_dump({"tenants": tenants}))
        options = ["--config", str(config), "--queue-timeout", "600", "--max-queue", "4096"]
        options += ["--max-concurrency", "4096", "--health-interval", "30"]
        with GatewayProcess(replicas.urls, *options, *args) as started:
            yield started


async def first_token(
    session: aiohttp.ClientSession, url: str, key: str, text: str, tokens: int
) -> float:
    """Seconds to the first streamed chunk with content; the stream is read to its end."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": tokens,
        "stream": True,
    }
    began = time.perf_counter()
    waited = 0.0
    async with session.post(
        url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
    ) as response:
        if response.status != 200:
            raise RuntimeError(f"{response.status}: {await response.text()}")
        async for line in response.content:
            if not waited and line.startswith(b"data: {") and b'"content"' in line:
                waited = time.perf_counter() - began
    return waited


async def flood(
    session: aiohttp.ClientSession, url: str, key: str, width: int, until: float, seed: int
) -> list[float]:
    """`width` requests in flight until `until`; their times to first token."""
    rng = random.Random(seed)
    found: list[float] = []

    async def one_lane(lane: int) -> None:
        turn = 0
        while time.monotonic() < until:
            tokens = rng.randint(64, 256)
            text = f"batch {seed} {lane} {turn}: summarise document {rng.random()}"
            found.append(await first_token(session, url, key, text, tokens))
            turn += 1

    await asyncio.gather(*(one_lane(lane) for lane in range(width)))
    return found


async def steady(url: str, key: str, seconds: float, document_words: int = 0) -> list[float]:
    """One short request at a time, with a pause between, for `seconds`; each asks about a
    document of `document_words` words of its own (none: a bare question), whose prefill is
    most of its time to first token when the replicas' prefill has a cost."""
    found: list[float] = []
    turn = 0
    until = time.monotonic() + seconds
    words = ("ledger", "harbour", "copper", "meadow", "signal", "lantern", "orchard", "vessel")
    run = random.Random().randrange(1 << 30)  # this client's documents are new to every cache
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        while time.monotonic() < until:
            document = " ".join(words[(turn + n) % len(words)] for n in range(document_words))
            text = f"{run} {turn}: {document} quick question {turn}?"
            found.append(await first_token(session, url, key, text, 16))
            turn += 1
            await asyncio.sleep(0.2)
    return found


def steady_client(url: str, key: str, seconds: float, document_words: int = 0) -> list[float]:
    """`steady` in the process it is called in (B's own client process)."""
    return asyncio.run(steady(url, key, seconds, document_words))


def quantiles(values: list[float]) -> tuple[float, float, float]:
    ordered = sorted(values)
    cut = statistics.quantiles(ordered, n=100, method="inclusive")
    return statistics.median(ordered), cut[89], cut[98]


async def neighbour_run(url: str, seconds: float, width: int) -> list[float]:
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=spawn) as client:
        quiet = asyncio.get_running_loop().run_in_executor(
            client, steady_client, url, "b-key", seconds
        )
        if width:
            connector = aiohttp.TCPConnector(limit=0)
            timeout = aiohttp.ClientTimeout(total=900)
            async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
                await asyncio.sleep(2)  # the flood fills the replicas first
                await flood(session, url, "a-key", width, time.monotonic() + seconds, 1)
        return await quiet


async def priority_run(url: str, seconds: float, width: int) -> tuple[list[float], list[float]]:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        until = time.monotonic() + seconds
        high, low = await asyncio.gather(
            flood(session, url, "high-key", width // 2, until, 2),
            flood(session, url, "low-key", width // 2, until, 3),
        )
        return high, low


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--flood", type=int, default=128)
    parser.add_argument("--decode-ms", type=float, default=4.0)
    given = parser.parse_args()
    emulator = ["--max-running", str(SLOTS), "--decode-ms-per-token", str(given.decode_ms)]
    tenants: list[dict[str, object]] = [
        {"name": "a", "api_key": "a-key"},
        {"name": "b", "api_key": "b-key"},
        {"name": "high", "api_key": "high-key", "priority": 1},
        {"name": "low", "api_key": "low-key"},
    ]
    fair = ("--max-inflight-per-replica", str(SLOTS))
    rows: list[tuple[str, list[float]]] = []
    with ExitStack() as stack:
        replicas = stack.enter_context(EmulatedReplicas(2, MODEL, emulator))
        for label, args, width in (
            ("B alone", (), 0),
            ("B beside A, first come first served", (), given.flood),
            ("B beside A, flow control", fair, given.flood),
        ):
            with gateway(replicas, tenants, *args) as started:
                rows.append((label, asyncio.run(neighbour_run(started.url, given.seconds, width))))
        with gateway(replicas, tenants, *fair) as started:
            high, low = asyncio.run(priority_run(started.url, given.seconds, given.flood))
    print(
        f"\n2 replicas x {SLOTS} slots, {given.decode_ms:g} ms/token; A keeps {given.flood} in"
        f" flight, B one at a time ({given.seconds:g} s each)\n"
    )
    print("| B's time to first token | requests | p50 | p90 | p99 |")
    print("| --- | --- | --- | --- | --- |")
    for label, values in rows:
        p50, p90, p99 = quantiles(values)
        times = " | ".join(f"{value * 1000:.0f} ms" for value in (p50, p90, p99))
        print(f"| {label} | {len(values)} | {times} |")
    print(f"\ntwo priority classes, {given.flood // 2} in flight each, flow control\n")
    print("| tenant | requests | time to first token p50 | p90 |")
    print("| --- | --- | --- | --- |")
    for label, values in (("priority 1", high), ("priority 0", low)):
        p50, p90, _ = quantiles(values)
        print(f"| {label} | {len(values)} | {p50 * 1000:.0f} ms | {p90 * 1000:.0f} ms |")


if __name__ == "__main__":
    main()
