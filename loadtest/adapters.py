"""LoRA adapters on a fleet with fewer adapter slots than adapters: what adapter affinity saves.

Four emulated replicas serve the same `--adapters` adapters, with `--max-loras` slots each: a
request for an adapter not in a slot swaps one out (`--swap-ms` before its prefill, counted in
the replica's `emulator:lora_swaps_total`). `--concurrency` clients send `--requests` streamed
chat requests, each for an adapter drawn with Zipf weights (a few popular adapters, a long
tail), with that adapter's own system prompt (about 400 tokens) and a question of its own.
Fresh replicas for each policy. Prints, per policy: swaps, prefix-cache hit rate (cached over
prompt tokens as the replicas reported them), time to first token, max/mean requests per
replica and the adapters each replica served (mean).

    python loadtest/adapters.py
    python loadtest/adapters.py --requests 1200 --concurrency 24 --policies prefix round_robin
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prefix_gateway.emulator.replicas import EmulatedReplicas
from prefix_gateway.processes import metric_value
from tests.support import GatewayProcess

MODEL = "adapters-model"
REPLICAS = 4
WORDS = ("tool", "paint", "timber", "screw", "hinge", "shelf", "glue", "drill", "clamp", "saw")


@dataclass
class Run:
    first_tokens: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    per_replica: Counter[str] = field(default_factory=Counter)
    adapters_on: defaultdict[str, set[str]] = field(default_factory=lambda: defaultdict(set))


def system_prompt(adapter: str) -> str:
    rng = random.Random(adapter)
    return f"You are the {adapter} assistant. " + " ".join(rng.choices(WORDS, k=380))


async def one(
    session: aiohttp.ClientSession, url: str, adapter: str, number: int, run: Run
) -> None:
    body = {
        "model": adapter,
        "messages": [
            {"role": "system", "content": system_prompt(adapter)},
            {"role": "user", "content": f"question {number}: where is the {WORDS[number % 10]}?"},
        ],
        "max_tokens": 16,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    began = time.perf_counter()
    first = 0.0
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{response.status}: {await response.text()}")
        backend = response.headers["x-gateway-backend"]
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            if not first and b'"content"' in line:
                first = time.perf_counter() - began
            chunk = orjson.loads(line[6:])
            usage = chunk.get("usage")
            if usage:
                run.prompt_tokens += usage["prompt_tokens"]
                run.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
    run.first_tokens.append(first)
    run.per_replica[backend] += 1
    run.adapters_on[backend].add(adapter)


async def drive(url: str, adapters: list[str], requests: int, concurrency: int, seed: int) -> Run:
    rng = random.Random(seed)
    weights = [1 / (rank + 1) for rank in range(len(adapters))]
    chosen = rng.choices(adapters, weights, k=requests)
    run = Run()
    queue = iter(enumerate(chosen))
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as session:

        async def lane() -> None:
            for number, adapter in queue:
                await one(session, url, adapter, number, run)

        await asyncio.gather(*(lane() for _ in range(concurrency)))
    return run


def measure(policy: str, given: argparse.Namespace) -> tuple[Run, float]:
    adapters = [f"adapter-{number}" for number in range(given.adapters)]
    emulator = [
        "--max-loras",
        str(given.max_loras),
        "--lora-swap-ms",
        str(given.swap_ms),
        "--prefill-us-per-token",
        str(given.prefill_us),
        "--decode-ms-per-token",
        str(given.decode_ms),
        "--lora-modules",
        *(f"{name}=/adapters/{name}" for name in adapters),
    ]
    with EmulatedReplicas(REPLICAS, MODEL, emulator) as replicas:
        options = ("--policy", policy, "--health-interval", "30", "--no-access-log")
        with GatewayProcess(replicas.urls, *options) as gateway:
            run = asyncio.run(
                drive(gateway.url, adapters, given.requests, given.concurrency, given.seed)
            )
        swaps = sum(
            metric_value(replica.metrics_text(), "emulator:lora_swaps_total")
            for replica in replicas.replicas
        )
    return run, swaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=800)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--max-loras", type=int, default=2)
    parser.add_argument("--swap-ms", type=float, default=20.0)
    parser.add_argument("--prefill-us", type=float, default=50.0)
    parser.add_argument("--decode-ms", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--policies", nargs="+", default=["prefix", "least_loaded", "round_robin", "random"]
    )
    given = parser.parse_args()
    print(
        f"\n{REPLICAS} replicas x {given.max_loras} adapter slots, {given.adapters} adapters"
        f" (Zipf), {given.requests} requests, {given.concurrency} concurrent, swap"
        f" {given.swap_ms:g} ms, prefill {given.prefill_us:g} us/token, decode"
        f" {given.decode_ms:g} ms/token\n"
    )
    print(
        "| policy | swaps | hit rate | TTFT p50 | TTFT p99 | max/mean requests |"
        " adapters per replica |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for policy in given.policies:
        run, swaps = measure(policy, given)
        ordered = sorted(run.first_tokens)
        p99 = statistics.quantiles(ordered, n=100, method="inclusive")[98]
        counts = [run.per_replica.get(name, 0) for name in run.per_replica] or [0]
        counts += [0] * (REPLICAS - len(counts))
        imbalance = max(counts) / statistics.mean(counts)
        spread = statistics.mean(len(served) for served in run.adapters_on.values())
        hit_rate = run.cached_tokens / max(run.prompt_tokens, 1)
        print(
            f"| {policy} | {swaps:.0f} | {hit_rate:.1%} | {statistics.median(ordered) * 1e3:.0f}"
            f" ms | {p99 * 1e3:.0f} ms | {imbalance:.2f} | {spread:.1f} |"
        )


if __name__ == "__main__":
    main()
