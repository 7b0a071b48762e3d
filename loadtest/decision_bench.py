"""Routing-decision micro-benchmark: parse, hash, index match and policy choice, in process.

For prompts of 1k to 128k tokens, fleets of 4 to 1,024 backends and an index holding 10k or
1M blocks, it times what the gateway does for one request before forwarding it:

- `decision`: parse the body, hash the blocks, match the index, choose (the design's budget:
  200 µs for an 8k-token prompt in memory);
- `route`: all of the router's work for the request, which adds recording the choice in the
  index, the session and conversation bookkeeping;
- the parts: `hash` (block chain), `match` (index), `choose` (policy).

    python loadtest/decision_bench.py
    python loadtest/decision_bench.py --tokens 8000 --backends 4 --indexed 10000 --samples 2000
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import string
import sys
import time
from collections.abc import Callable
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prefix_gateway.backends.backend import Backend
from prefix_gateway.backends.pool import BackendPool
from prefix_gateway.config import Settings
from prefix_gateway.metrics import Metrics
from prefix_gateway.prompt.hashing import chain_hashes
from prefix_gateway.prompt.parsing import Endpoint, parse_request
from prefix_gateway.routing.policies import build_policy
from prefix_gateway.routing.recorder import Stores
from prefix_gateway.routing.router import Router
from prefix_gateway.state.index import InMemoryPrefixIndex
from prefix_gateway.state.sessions import InMemorySessionStore

MODEL = "bench"


def text(rng: random.Random, tokens: int) -> str:
    # About four characters a token, as the gateway's block chunking assumes.
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=3)) for _ in range(tokens))


def build(backends: int, indexed: int, rng: random.Random) -> tuple[Settings, Router]:
    settings = Settings(backend=("x:1",))
    pool = BackendPool()
    for number in range(backends):
        pool.add(
            Backend(
                name=f"10.0.{number // 250}.{number % 250}:8000",
                url="http://unused",
                models=frozenset({MODEL}),
                healthy=True,
            )
        )
    index = InMemoryPrefixIndex(settings.affinity_ttl, max(settings.index_max_blocks, indexed))
    names = [backend.name for backend in pool.backends]

    async def fill() -> None:
        for chain, start in enumerate(range(0, indexed, 500)):
            hashes = [hash((chain, depth)) & (2**64 - 1) for depth in range(500)]
            await index.record(MODEL, rng.choice(names), hashes[: indexed - start])

    asyncio.run(fill())
    stores = Stores(index, InMemorySessionStore(600, 1000))
    router = Router(settings, pool, stores, build_policy(settings), Metrics())
    return settings, router


def timed(samples: int, call: Callable[[], object]) -> tuple[float, float]:
    times = []
    for _ in range(samples):
        began = time.perf_counter()
        call()
        times.append(time.perf_counter() - began)
    times.sort()
    return statistics.median(times) * 1e6, times[int(0.99 * (len(times) - 1))] * 1e6


def measure(tokens: int, backends: int, indexed: int, samples: int) -> dict[str, float]:
    rng = random.Random(tokens * 7 + backends)
    settings, router = build(backends, indexed, rng)
    system = text(rng, tokens)
    bodies = [
        orjson.dumps(
            {
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": text(rng, 20)},
                ],
            }
        )
        for _ in range(16)
    ]
    loop = asyncio.new_event_loop()
    # The shared prompt is already held by three backends: the match walks its whole depth.
    first = parse_request(Endpoint.CHAT, bodies[0], None)
    for _ in range(3):
        loop.run_until_complete(router.route(first))
    turn = iter(range(10**9))

    def decision() -> None:
        request = parse_request(Endpoint.CHAT, bodies[next(turn) % 16], None)
        loop.run_until_complete(router.decide(request))

    def route() -> None:
        request = parse_request(Endpoint.CHAT, bodies[next(turn) % 16], None)
        loop.run_until_complete(router.route(request))

    request = parse_request(Endpoint.CHAT, bodies[1], None)
    hashes = chain_hashes(request.canonical, settings.block_chars)
    state = loop.run_until_complete(router.decide(request)).state
    index = router.memory.index
    results = {
        "decision": timed(samples, decision),
        "route": timed(samples, route),
        "hash": timed(samples, lambda: chain_hashes(request.canonical, settings.block_chars)),
        "match": timed(samples, lambda: loop.run_until_complete(index.match(MODEL, hashes))),
        "choose": timed(samples, lambda: router.policy.choose(state)),
    }
    loop.close()
    return {
        "blocks": len(hashes),
        **{f"{k}_{q}": v[i] for k, v in results.items() for i, q in enumerate(("p50", "p99"))},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1000,8000,32000,128000")
    parser.add_argument("--backends", default="4,64,1024")
    parser.add_argument("--indexed", default="10000,1000000")
    parser.add_argument("--samples", type=int, default=500)
    args = parser.parse_args()
    print(f"# python {sys.version.split()[0]}; microseconds; {args.samples} samples a row")
    print(
        "| prompt tokens | blocks | backends | indexed blocks | decision p50 | decision p99 "
        "| route p50 | hash p50 | match p50 | choose p50 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    cases = []
    tokens_list = [int(value) for value in args.tokens.split(",")]
    backends_list = [int(value) for value in args.backends.split(",")]
    indexed_list = [int(value) for value in args.indexed.split(",")]
    for indexed in indexed_list:
        for tokens in tokens_list:
            cases.append((tokens, backends_list[0], indexed))
        for backends in backends_list[1:]:
            cases.append((8000, backends, indexed))
    for tokens, backends, indexed in cases:
        row = measure(tokens, backends, indexed, args.samples)
        print(
            f"| {tokens:,} | {row['blocks']:,} | {backends:,} | {indexed:,} "
            f"| {row['decision_p50']:.0f} | {row['decision_p99']:.0f} | {row['route_p50']:.0f} "
            f"| {row['hash_p50']:.0f} | {row['match_p50']:.0f} | {row['choose_p50']:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
