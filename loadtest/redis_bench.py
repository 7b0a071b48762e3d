"""Shared state in Redis: lookup cost, a fleet's hit rate, and memory per conversation.

Three tables, each from real processes on loopback (a private redis-server, emulated replicas,
gateway processes):

1. `lookup` — the routing lookup in one process, in memory vs through Redis, for prompts of
   1k, 8k and 32k tokens whose every block is indexed (the deepest, costliest match): the
   index match alone, and the whole routing decision (parse, hash, match, choose, record).
2. `fleet` — per-customer prompts and conversations through 1, 3 and 8 gateway processes on
   one Redis and 3 on a Redis Cluster, a session's requests rotated over the gateways: hit
   rate, max/mean requests per replica, failures, Redis calls per request
   (`loadtest/fleet_bench.py`).
3. `memory` — Redis memory for 1,000 six-turn conversations written as gateways write them,
   and `MEMORY USAGE` of one block key.

    python loadtest/redis_bench.py                 # all three
    python loadtest/redis_bench.py lookup --samples 2000 --repeat 3
    python loadtest/redis_bench.py fleet --gateways 1,3,8 --cluster-gateways 3
    python loadtest/redis_bench.py fleet --workloads conversation --gateways 1,3 --local-gateways 3
    python loadtest/redis_bench.py fleet --gateways 8 --kill-redis 8
    python loadtest/redis_bench.py fleet --rotation request --workloads customer-prompts \
        --cache-blocks 2000 --concurrency 16 --think 0 --seeds 1,2,3
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import string
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import orjson
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtest.fleet_bench import fleet, numbers
from prefix_gateway.backends.backend import Backend
from prefix_gateway.backends.pool import BackendPool
from prefix_gateway.clock import ManualClock
from prefix_gateway.config import Settings
from prefix_gateway.metrics import Metrics
from prefix_gateway.prompt.canonical import message_segment
from prefix_gateway.prompt.hashing import chain_hashes, extend_hashes
from prefix_gateway.prompt.parsing import Endpoint, parse_request
from prefix_gateway.routing.policies import build_policy
from prefix_gateway.routing.recorder import Stores
from prefix_gateway.routing.router import Router
from prefix_gateway.state import redis as redis_store
from prefix_gateway.state.index import InMemoryPrefixIndex, PrefixIndex
from prefix_gateway.state.redis.connection import RedisClient
from prefix_gateway.state.sessions import InMemorySessionStore, SessionStore
from tests.redis_server import RedisServer

MODEL = "bench-model"
# `gateway_affinity_misses_total` causes; a gateway counts a move only between turns it saw.
MISS_CAUSES = ("load_bound", "index", "spread", "unhealthy", "failover")
REDIS_OPERATIONS = ("match", "record", "forget", "session_get", "session_put")
BACKENDS = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000")


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def prose(rng: random.Random, tokens: int) -> str:
    """`tokens` short words: about four characters, one token, each."""
    letters = string.ascii_lowercase
    return " ".join("".join(rng.choices(letters, k=3)) for _ in range(tokens))


# --- 1. lookup ---------------------------------------------------------------------------------


@dataclass
class Stack:
    router: Router
    index: PrefixIndex
    shared: redis_store.SharedState | None = None

    async def close(self) -> None:
        if self.shared is not None:
            await self.shared.link.close()

    async def settle(self) -> None:
        """Wait until the background writes in flight have landed."""
        while self.shared is not None and self.shared.link.pending:
            await asyncio.sleep(0.0005)


async def build_stack(settings: Settings) -> Stack:
    """A router as `Components` builds it, over four backends that never receive a request."""
    pool = BackendPool()
    for name in BACKENDS:
        pool.add(Backend(name, f"http://{name}", frozenset({MODEL}), healthy=True))
    metrics = Metrics()
    local_index = InMemoryPrefixIndex(settings.affinity_ttl, settings.index_max_blocks)
    local_sessions = InMemorySessionStore(settings.affinity_ttl, settings.session_max)
    index: PrefixIndex = local_index
    sessions: SessionStore = local_sessions
    shared = None
    if settings.redis_url:
        local_responses = InMemorySessionStore(settings.affinity_ttl, settings.session_max)
        shared = redis_store.connect(
            settings, metrics, local_index, local_sessions, local_responses
        )
        await shared.link.start()
        assert shared.link.up, "Redis did not answer"
        index, sessions = shared.index, shared.sessions
    agreement = shared.agreement if shared is not None else None
    stores = Stores(index, sessions, agreement=agreement)
    router = Router(settings, pool, stores, build_policy(settings), metrics)
    return Stack(router, index, shared)


def prompts(tokens: int, count: int = 8) -> list[bytes]:
    """Chat bodies of `tokens` tokens: a long system prompt and a short question each."""
    rng = random.Random(tokens)
    bodies = []
    for variant in range(count):
        messages = [
            {"role": "system", "content": prose(rng, tokens - 20)},
            {"role": "user", "content": f"question {variant} " + prose(rng, 18)},
        ]
        bodies.append(orjson.dumps({"model": MODEL, "messages": messages}))
    return bodies


async def time_lookups(settings: Settings, tokens: int, samples: int) -> dict[str, float]:
    stack = await build_stack(settings)
    bodies = prompts(tokens)
    chains = []
    for body in bodies:
        request = parse_request(Endpoint.CHAT, body, None)
        chain = chain_hashes(request.canonical, settings.block_chars)
        chains.append(chain)
        for backend in BACKENDS[:2]:
            await stack.index.record(MODEL, backend, chain)
            stack.index.share(MODEL, backend, chain)  # as a replica accepting it does
    await stack.settle()
    match_times: list[float] = []
    decision_times: list[float] = []
    for sample in range(samples):
        # Requests arrive one at a time: the previous one's writes have landed (Redis's time
        # for writes is measured apart, below).
        await stack.settle()
        chain = chains[sample % len(chains)]
        began = time.perf_counter()
        matched = await stack.index.match(MODEL, chain)
        match_times.append(time.perf_counter() - began)
        assert max(matched.values()) == len(chain), "the prompt should be fully indexed"
        body = bodies[sample % len(bodies)]
        began = time.perf_counter()
        await stack.router.route(parse_request(Endpoint.CHAT, body, None))
        decision_times.append(time.perf_counter() - began)
    redis_us = {"lookup": 0.0, "write": 0.0, "refresh": 0.0}
    if stack.shared is not None:
        await stack.settle()
        redis_us = await redis_time_per_script(
            stack.shared.link.client, settings.redis_prefix, chains
        )
    await stack.close()
    return {
        "blocks": len(chains[0]),
        "match_p50": percentile(match_times, 0.5) * 1e6,
        "match_p99": percentile(match_times, 0.99) * 1e6,
        "decision_p50": percentile(decision_times, 0.5) * 1e6,
        "decision_p99": percentile(decision_times, 0.99) * 1e6,
        **redis_us,
    }


async def redis_time_per_script(
    client: RedisClient, namespace: str, chains: list[list[int]]
) -> dict[str, float]:
    """Redis's own µs per lookup, per write of a prompt none of whose blocks the backend was
    sent within the refresh window, and per write of one it was (only read, not rewritten)."""
    # A namespace of its own: the writes below run the clock ahead, and a stamp is never
    # lowered, so a second run in the same namespace would find every block stamped already.
    keys = redis_store.KeySpace(f"{namespace}-{uuid.uuid4().hex[:8]}")
    clock = ManualClock(time.time())
    index = redis_store.RedisPrefixIndex(client, keys, 600, clock)
    for chain in chains:
        for backend in BACKENDS[:2]:
            await index.record(MODEL, backend, chain)
    times = {}
    for kind in ("lookup", "write", "refresh"):
        if kind == "refresh":
            # Every chain written once in the current period; the timed writes then find
            # every block stamped already.
            for chain in chains:
                await index.record(MODEL, BACKENDS[2], chain)
        await client.config_resetstat()
        for chain in chains * 10:
            if kind == "lookup":
                await index.match(MODEL, chain)
            else:
                clock.advance(60 if kind == "write" else 0)
                await index.record(MODEL, BACKENDS[2], chain)
        stats = await client.info("commandstats")
        times[kind] = float(stats["cmdstat_evalsha"]["usec_per_call"])
    return times


def lookup(args: argparse.Namespace) -> None:
    print(
        f"# routing lookup in one process (uvloop), {args.samples} samples per run, median of "
        f"{args.repeat} run(s) per figure, one request "
        "at a time; every block of the prompt indexed on 2 of 4 backends; Redis on loopback. "
        "decision = parse, hash, match, choose and record, as Router.route does it. Redis µs = "
        "Redis's own time per script (INFO commandstats): a lookup, a write of a prompt's "
        "blocks, a write of blocks written within the refresh window (read, not rewritten)"
    )
    print(
        "| prompt tokens | blocks | index | match p50 µs | match p99 µs | decision p50 µs "
        "| decision p99 µs | Redis µs: lookup | write | refresh |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    with RedisServer() as server:
        added = []
        for tokens in args.tokens:
            rows = {}
            for state in ("memory", "redis", "redis + agreement"):
                settings = Settings(
                    backend=BACKENDS,
                    redis_url=server.url if state != "memory" else "",
                    # The index alone, or with the claim and prompt count read beside it.
                    fleet_share=("claims", "prompts") if state != "redis" else ("none",),
                )
                # The gateway serves on uvloop (uvicorn's choice when it is installed).
                runs = []
                for _ in range(args.repeat):
                    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                        runs.append(runner.run(time_lookups(settings, tokens, args.samples)))
                row = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
                rows[state] = row
                redis_times = (
                    f"{row['lookup']:.0f} | {row['write']:.0f} | {row['refresh']:.0f}"
                    if state != "memory"
                    else "– | – | –"
                )
                print(
                    f"| {tokens:,} | {row['blocks']:.0f} | {state} | {row['match_p50']:.0f} "
                    f"| {row['match_p99']:.0f} | {row['decision_p50']:.0f} "
                    f"| {row['decision_p99']:.0f} | {redis_times} |",
                    flush=True,
                )
            for over, under in (("redis", "memory"), ("redis + agreement", "redis")):
                extra = {key: rows[over][key] - rows[under][key] for key in rows[over]}
                added.append((tokens, f"{over} minus {under}", extra))
    print("\n# what Redis adds, and what the fleet agreement adds to it")
    print(
        "| prompt tokens | rows | match p50 µs | match p99 µs | decision p50 µs | decision p99 µs |"
    )
    print("|---|---|---|---|---|---|")
    for tokens, label, extra in added:
        print(
            f"| {tokens:,} | {label} | {extra['match_p50']:+.0f} | {extra['match_p99']:+.0f} "
            f"| {extra['decision_p50']:+.0f} | {extra['decision_p99']:+.0f} |"
        )


# --- 3. memory ---------------------------------------------------------------------------------


async def write_conversations(url: str, conversations: int, settings: Settings) -> int:
    """Write what gateways write for `conversations` six-turn conversations; the block count."""
    client = redis_store.open_client(url, timeout=5.0, max_connections=4)
    keys = redis_store.KeySpace(settings.redis_prefix)
    index = redis_store.RedisPrefixIndex(client, keys, settings.affinity_ttl)
    sessions = redis_store.RedisSessionStore(client, keys, settings.affinity_ttl)
    rng = random.Random(7)
    system = prose(rng, 1000)
    blocks: set[int] = set()
    for conversation in range(conversations):
        backend = BACKENDS[conversation % len(BACKENDS)]
        messages = [{"role": "system", "content": system}]
        for _turn in range(6):
            messages.append({"role": "user", "content": prose(rng, 100)})
            body = orjson.dumps({"model": MODEL, "messages": messages})
            request = parse_request(Endpoint.CHAT, body, f"conversation-{conversation}")
            prompt = chain_hashes(request.canonical, settings.block_chars)
            await index.record(MODEL, backend, prompt)
            await sessions.put(f"conversation-{conversation}", backend)
            answer = prose(rng, 300)
            history = request.canonical + message_segment("assistant", answer)
            answered = extend_hashes(prompt, history, settings.block_chars)
            await index.record(MODEL, backend, answered)
            blocks.update(answered)
            messages.append({"role": "assistant", "content": answer})
    await client.aclose()
    return len(blocks)


async def used_memory(url: str) -> int:
    client = redis_store.open_client(url, timeout=5.0, max_connections=2)
    info = await client.info("memory")
    await client.aclose()
    return int(info["used_memory"])


async def block_key_usage(url: str, settings: Settings) -> list[tuple[int, int, int]]:
    """(backends holding it, key name length, `MEMORY USAGE`) of one block key."""
    client = redis_store.open_client(url, timeout=5.0, max_connections=2)
    keys = redis_store.KeySpace(settings.redis_prefix)
    index = redis_store.RedisPrefixIndex(client, keys, settings.affinity_ttl)
    chain = chain_hashes(b"x" * settings.block_chars * 4, settings.block_chars)
    prefix = keys.block_prefix(MODEL, chain[0])
    key = keys.block_keys(prefix, chain[1:2])
    rows = []
    for holders, backend in enumerate(BACKENDS, start=1):
        await index.record(MODEL, backend, chain)
        rows.append((holders, len(key), int(await client.memory_usage(key, samples=0) or 0)))
    await client.aclose()
    return rows


def memory(args: argparse.Namespace) -> None:
    settings = Settings(backend=BACKENDS)
    with RedisServer() as server:
        before = asyncio.run(used_memory(server.url))
        blocks = asyncio.run(write_conversations(server.url, args.conversations, settings))
        used = asyncio.run(used_memory(server.url)) - before
        keys = int(server.cli("dbsize"))
    print(
        f"# {args.conversations:,} six-turn conversations sharing a 1,000-token system prompt "
        "(100-token questions, 300-token answers), each on one backend, each with a session key"
    )
    print(
        "| conversations | keys | block keys | used_memory growth | per 1,000 conversations "
        "| per key |"
    )
    print("|---|---|---|---|---|---|")
    print(
        f"| {args.conversations:,} | {keys:,} | {blocks:,} | {used / 2**20:.1f} MiB "
        f"| {used / args.conversations * 1000 / 2**20:.1f} MiB | {used / keys:.0f} B |"
    )
    with RedisServer() as server:
        rows = asyncio.run(block_key_usage(server.url, settings))
    print("\n# MEMORY USAGE <block key> SAMPLES 0, as more backends hold the block")
    print("| backends holding the block | key name bytes | MEMORY USAGE bytes |")
    print("|---|---|---|")
    for holders, name_bytes, usage in rows:
        print(f"| {holders} | {name_bytes} | {usage} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "part", nargs="?", default="all", choices=["all", "lookup", "fleet", "memory"]
    )
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument(
        "--repeat", type=int, default=1, help="lookup: runs per row; each figure is their median"
    )
    parser.add_argument("--tokens", default="1000,8000,32000", help="prompt sizes for lookup")
    parser.add_argument("--workloads", default="customers,conversation")
    parser.add_argument("--gateways", default="1,3,8", help="fleet: gateways on one Redis")
    parser.add_argument("--cluster-gateways", default="3", help="fleet: gateways on a cluster")
    parser.add_argument("--local-gateways", default="", help="fleet: gateways without Redis")
    parser.add_argument("--gateway-args", default="", help="extra flags for every gateway")
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--think", type=float, default=0.1, help="fleet: seconds between requests")
    parser.add_argument(
        "--rotation",
        choices=["session", "request"],
        default="session",
        help="fleet: rotate each session's requests from its own number, or every request to"
        " the next gateway (streamed)",
    )
    parser.add_argument("--cache-blocks", type=int, default=1024)
    parser.add_argument(
        "--checkout", default=None, help="fleet: run the gateways of this other source tree"
    )
    parser.add_argument(
        "--trace-copies",
        action="store_true",
        help="fleet: gateways log every decision (DEBUG); print each one that put a shared"
        " prompt on another replica than its earlier ones, with what its gateway was shown",
    )
    parser.add_argument("--seeds", default="1")
    parser.add_argument(
        "--kill-redis", type=float, default=0.0, help="fleet: SIGKILL Redis this many s in"
    )
    parser.add_argument("--redis-down", type=float, default=2.0, help="fleet: seconds away")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--conversations", type=int, default=1000)
    args = parser.parse_args()
    args.tokens = numbers(args.tokens)
    if args.part in ("all", "lookup"):
        lookup(args)
    if args.part in ("all", "fleet"):
        fleet(args)
    if args.part in ("all", "memory"):
        memory(args)


if __name__ == "__main__":
    main()
