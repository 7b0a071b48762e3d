"""Agent-like conversations on Anthropic's Messages API, through the gateway and without it.

Four emulated replicas with a prefill cost (`--prefill-us`, 100 µs per uncached token by
default, one prefill at a time per replica) and no decode delay, so that time to first token
is the wait for uncached prefill. `--conversations` conversations of `--turns` turns, eight at
a time, the way a coding agent talks: one long system prompt (about 1,200 tokens) and three
tools shared by every conversation, each turn's answer a tool call (`tool_choice: any`) whose
result (about 60 tokens) opens the next turn with a new question (about 40 tokens); every
request streamed, every run's text its own. Each turn re-sends the whole conversation.

Routers: the gateway with its `prefix` policy, the gateway with `round_robin`, round robin
straight over the replicas (a plain load balancer) and the peer routers named by `--peers`
(loadtest/peers.py; SGLang's router with `cache_aware` by default, as loadtest/benchmark.py
runs it). One row per router: the prompt
tokens the replicas report (`input_tokens + cache_read_input_tokens +
cache_creation_input_tokens`) and the share read from their caches, the spread of requests
over the replicas (the most any answered over the mean), the time to the first event and,
through the gateway, the turns it counted as cache breaks (none is expected). A router that
answers no turn gets a row that says what it answered instead (each conversation stops at
its first failed turn).

    python loadtest/messages_agents.py
    python loadtest/messages_agents.py --conversations 64 --turns 8 --prefill-us 50
    python loadtest/messages_agents.py --peers sglang-cache_aware,sglang-round_robin
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtest.peers import PEERS, start_peer
from loadtest.responses_chains import CONCURRENCY, MODEL, Targets, answered
from prefix_gateway.emulator.replicas import EmulatedReplicas
from tests.support import GatewayProcess
from tests.words import words

SYSTEM_TOKENS = 1200
BREAKS = "gateway_cache_breaks_total"
TOOLS = [
    {
        "name": name,
        "description": f"{name.replace('_', ' ')} in the working tree",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
    }
    for name in ("read_file", "run_tests", "edit_file")
]


@dataclass
class Tally:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    failed: int = 0
    refusals: Counter[int] = field(default_factory=Counter)
    """The failed turns' statuses."""


async def turn(
    client: httpx.AsyncClient, url: str, system: str, history: list[Any], tally: Tally
) -> list[Any] | None:
    """One streamed turn; the answer's content blocks, or None when it failed."""
    body = {
        "model": MODEL,
        "max_tokens": 16,
        "system": system,
        "tools": TOOLS,
        "tool_choice": {"type": "any"},
        "messages": history,
        "stream": True,
    }
    started = time.perf_counter()
    first = 0.0
    call: dict[str, Any] = {}
    arguments: list[str] = []
    async with client.stream("POST", url + "/v1/messages", json=body) as reply:
        if reply.status_code != 200:
            tally.failed += 1
            tally.refusals[reply.status_code] += 1
            return None
        async for line in reply.aiter_lines():
            if not first:
                first = time.perf_counter() - started
            if not line.startswith("data: "):
                continue
            event = orjson.loads(line[6:])
            kind = event["type"]
            if kind == "content_block_start":
                call = event["content_block"]
            elif kind == "content_block_delta":
                arguments.append(event["delta"].get("partial_json", ""))
            elif kind == "message_delta":
                usage = event["usage"]
                cached = usage.get("cache_read_input_tokens", 0)
                written = usage.get("cache_creation_input_tokens", 0)
                tally.prompt_tokens += usage["input_tokens"] + cached + written
                tally.cached_tokens += cached
    tally.ttfts.append(first)
    return [{**call, "input": orjson.loads("".join(arguments) or "{}")}]


async def conversation(
    client: httpx.AsyncClient, targets: Targets, system: str, tag: str, turns: int
) -> Tally:
    tally = Tally()
    history: list[Any] = []
    result: list[Any] = []
    for number in range(turns):
        question = {"type": "text", "text": f"{tag} step {number}: {words(40, 'q')}"}
        history.append({"role": "user", "content": [*result, question]})
        answer = await turn(client, targets.next(), system, history, tally)
        if answer is None:
            break
        history.append({"role": "assistant", "content": answer})
        output = f"{tag} output {number}: {words(60, 'o')}"
        result = [{"type": "tool_result", "tool_use_id": answer[0]["id"], "content": output}]
    return tally


async def run(targets: Targets, run_id: str, conversations: int, turns: int) -> Tally:
    gate = asyncio.Semaphore(CONCURRENCY)
    system = f"{run_id}. {words(SYSTEM_TOKENS, 's')}"
    total = Tally()
    async with httpx.AsyncClient(timeout=120) as client:

        async def one(number: int) -> Tally:
            async with gate:
                return await conversation(client, targets, system, f"{run_id}-{number}", turns)

        for tally in await asyncio.gather(*(one(number) for number in range(conversations))):
            total.prompt_tokens += tally.prompt_tokens
            total.cached_tokens += tally.cached_tokens
            total.ttfts += tally.ttfts
            total.failed += tally.failed
            total.refusals += tally.refusals
    return total


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else 0.0


def start_router(
    stack: contextlib.ExitStack, router: str, fleet: EmulatedReplicas
) -> tuple[list[str], GatewayProcess | None]:
    """The URLs to send turns to for `router`, and the gateway when it is ours."""
    if router.startswith("gateway"):
        policy = router.split()[1]
        gateway = stack.enter_context(GatewayProcess(fleet.urls, "--policy", policy))
        return [gateway.url], gateway
    if router in PEERS:
        peer = start_peer(router, fleet.urls, MODEL)
        stack.callback(peer.stop)
        return [peer.router.url], None
    return fleet.urls, None


def row(router: str, tally: Tally, counts: list[float], gateway: GatewayProcess | None) -> str:
    if not tally.ttfts:
        answered_with = ", ".join(f"{status} ×{n}" for status, n in sorted(tally.refusals.items()))
        return (
            f"| {router} | 0 | {tally.failed} ({answered_with}) | – | – | not routed "
            "| – | – | – | – |"
        )
    spread = max(counts) / (sum(counts) / len(counts)) if sum(counts) else 0
    rate = tally.cached_tokens / tally.prompt_tokens if tally.prompt_tokens else 0
    breaks = "–" if gateway is None else f"{gateway.metric(BREAKS):g}"
    return (
        f"| {router} | {len(tally.ttfts)} | {tally.failed} "
        f"| {tally.prompt_tokens:,} | {tally.cached_tokens:,} | {rate:.1%} "
        f"| {spread:.2f} | {percentile(tally.ttfts, 0.5) * 1000:.1f} "
        f"| {percentile(tally.ttfts, 0.99) * 1000:.1f} | {breaks} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--prefill-us", type=float, default=100)
    parser.add_argument(
        "--peers",
        default="sglang-cache_aware",
        help=f"peer routers to add, comma-separated ('' for none): {', '.join(PEERS)}",
    )
    args = parser.parse_args()
    peers = [name for name in args.peers.split(",") if name]
    emulator_args = ["--prefill-us-per-token", str(args.prefill_us), "--decode-ms-per-token", "0"]
    print(
        f"{args.conversations} conversations of {args.turns} turns, 4 emulated replicas, "
        f"prefill {args.prefill_us:g} µs per uncached token\n"
    )
    print(
        "| router | requests | failed | prompt tokens | cached tokens | hit rate "
        "| max/mean req | TTFT p50 ms | TTFT p99 ms | cache breaks |"
    )
    print("|" + "---|" * 10)
    with EmulatedReplicas(4, MODEL, emulator_args) as fleet:
        runs = itertools.count(1)
        for router in ("gateway prefix", "gateway round_robin", "direct round robin", *peers):
            with contextlib.ExitStack() as stack:
                urls, gateway = start_router(stack, router, fleet)
                before = answered(fleet)
                tally = asyncio.run(
                    run(Targets(urls), f"Run {next(runs)}", args.conversations, args.turns)
                )
                counts = [now - then for now, then in zip(answered(fleet), before, strict=True)]
                print(row(router, tally, counts, gateway), flush=True)


if __name__ == "__main__":
    main()
