"""A tenant's tokens per minute across a fleet: what 1 and 3 gateways sharing one Redis serve
of a tenant that offers about twice its limit.

Real processes on loopback: a private redis-server, emulated replicas, gateway processes with
one `tenants:` file holding the tenant `bench` and its `tokens_per_minute`. Requests of about
100 tokens (a prompt of short words and `max_tokens`) arrive at a steady pace (open loop) in
rotation over the gateways, as a Service spreads them. Each request's cost is counted as its
budget counts it — prompt tokens not cached, cached ones at 0.1, and the completion, from the
usage in the answer — and put in the minute in which it was sent. The bucket starts full (a
minute's worth), so the minutes measured begin with the first refusal, once that is spent (or
after `--warm-up` seconds without one: gateways that each enforce the whole limit alone, added
with `--local-gateways N` for comparison, never refuse this load).

    python loadtest/tenant_budgets.py
    python loadtest/tenant_budgets.py --gateways 1,3 --local-gateways 3 --minutes 2
"""

from __future__ import annotations

import argparse
import asyncio
import random
import string
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prefix_gateway.emulator.replicas import EmulatedReplicas
from tests.redis_server import RedisServer
from tests.support import GatewayProcess, wait_until

MODEL = "bench-model"
KEY = "bench-key"
PROMPT_WORDS = 40
MAX_TOKENS = 60
CACHED_COST = 0.1


@dataclass
class Sent:
    at: float
    """Seconds from the start of the run."""
    status: int
    """0: no answer."""
    cost: float = 0.0
    """What an answered request cost the budget."""


@dataclass
class Minute:
    offered: float = 0.0
    """Tokens the requests sent in this minute asked for (prompt words and max_tokens)."""
    served: float = 0.0
    """Tokens the answered requests cost the budget."""
    requests: int = 0
    refused: int = 0
    failed: int = 0


@dataclass
class Run:
    label: str
    gateways: int
    warm_up: float
    """Seconds until the first refusal (the full bucket drained), or the most waited for it."""
    minutes: list[Minute] = field(default_factory=list)
    fallbacks: float = 0.0


def prompt(rng: random.Random, letters: int) -> str:
    """`PROMPT_WORDS` words, one emulated token each (up to six letters)."""
    alphabet = string.ascii_lowercase
    return " ".join("".join(rng.choices(alphabet, k=letters)) for _ in range(PROMPT_WORDS))


async def one_request(
    client: httpx.AsyncClient, url: str, text: str, began: float, sent: list[Sent]
) -> None:
    record = Sent(time.monotonic() - began, 0)
    sent.append(record)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": MAX_TOKENS,
    }
    try:
        answer = await client.post(
            url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"}
        )
    except httpx.HTTPError:
        return
    record.status = answer.status_code
    if answer.status_code == 200:
        usage = answer.json()["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        uncached = usage["prompt_tokens"] - cached
        record.cost = uncached + cached * CACHED_COST + usage["completion_tokens"]


async def offer(
    urls: list[str], per_second: float, args: argparse.Namespace, rng: random.Random
) -> tuple[list[Sent], float]:
    """Requests at `per_second`, open loop, rotated over `urls`, until `args.minutes` minutes
    after the first refusal (or after `args.warm_up` seconds without one); every request, and
    when the measured minutes began."""
    minutes, warm_up = args.minutes, args.warm_up
    sent: list[Sent] = []
    running: set[asyncio.Task[None]] = set()
    limits = httpx.Limits(max_connections=256)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        began = time.monotonic()
        count = 0
        measured_from = warm_up
        while True:
            if measured_from == warm_up:
                refused = (record.at for record in sent if record.status == 429)
                measured_from = min(next(refused, warm_up), warm_up)
            if count / per_second >= measured_from + minutes * 60:
                break
            await asyncio.sleep(max(0.0, began + count / per_second - time.monotonic()))
            url = urls[count % len(urls)]
            text = prompt(rng, args.word_letters)
            task = asyncio.create_task(one_request(client, url, text, began, sent))
            running.add(task)
            task.add_done_callback(running.discard)
            count += 1
        await asyncio.gather(*running)
    return sent, measured_from


def tally(sent: list[Sent], measured_from: float, minutes: int) -> list[Minute]:
    counted = [Minute() for _ in range(minutes)]
    for record in sent:
        position = int((record.at - measured_from) // 60)
        if not 0 <= position < minutes:
            continue
        minute = counted[position]
        minute.offered += PROMPT_WORDS + MAX_TOKENS
        if record.status == 200:
            minute.served += record.cost
            minute.requests += 1
        elif record.status == 429:
            minute.refused += 1
        else:
            minute.failed += 1
    return counted


def run(
    label: str,
    gateways: int,
    shared: bool,
    args: argparse.Namespace,
    replicas: EmulatedReplicas,
) -> Run:
    with ExitStack() as stack, tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "gateway.yaml"
        tenant = {"name": "bench", "api_key": KEY, "tokens_per_minute": args.tokens_per_minute}
        config.write_text(yaml.safe_dump({"tenants": [tenant]}))
        flags = ["--config", str(config), "--log-level", "warning"]
        if shared:
            redis = stack.enter_context(RedisServer())
            flags += ["--redis-url", redis.url, "--redis-timeout", str(args.redis_timeout)]
        started = [
            stack.enter_context(GatewayProcess(replicas.urls, *flags)) for _ in range(gateways)
        ]
        if shared:
            wait_until(
                lambda: all(gateway.metric("gateway_redis_up") == 1 for gateway in started),
                "every gateway on Redis",
            )
        # About 100 tokens a request: twice the limit's worth of them a second.
        per_second = args.offered * args.tokens_per_minute / 60 / (PROMPT_WORDS + MAX_TOKENS)
        urls = [gateway.url for gateway in started]
        # A seed per run: no run finds another's prompts in the replicas' caches.
        rng = random.Random(f"{args.seed} {label} {gateways}")
        sent, measured_from = asyncio.run(offer(urls, per_second, args, rng))
        fallbacks = sum(
            gateway.metric("gateway_redis_fallbacks_total", operation="budget_take")
            for gateway in started
        )
        minutes = tally(sent, measured_from, args.minutes)
        return Run(label, gateways, measured_from, minutes, fallbacks)


def table(runs: list[Run], limit: int) -> str:
    lines = [
        "| gateways | budgets | until the first refusal | minute after it | offered tokens"
        " | served tokens | served / limit | requests served | refused | failed"
        " | Redis fallbacks (whole run) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for result in runs:
        for position, minute in enumerate(result.minutes):
            lines.append(
                f"| {result.gateways} | {result.label} | {result.warm_up:.0f} s | {position + 1}"
                f" | {minute.offered:,.0f} | {minute.served:,.0f}"
                f" | {minute.served / limit:.3f} | {minute.requests} | {minute.refused}"
                f" | {minute.failed} | {result.fallbacks:.0f} |"
            )
        count = len(result.minutes)
        served = sum(minute.served for minute in result.minutes) / count
        offered = sum(minute.offered for minute in result.minutes) / count
        requests = sum(minute.requests for minute in result.minutes) / count
        lines.append(
            f"| {result.gateways} | {result.label} | | per minute | {offered:,.0f}"
            f" | {served:,.0f} | **{served / limit:.3f}** | {requests:.0f} | | | |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gateways", default="1,3", help="fleet sizes on one Redis")
    parser.add_argument("--local-gateways", type=int, default=0, help="also N without Redis")
    parser.add_argument("--tokens-per-minute", type=int, default=24_000)
    parser.add_argument("--offered", type=float, default=2.0, help="load as a multiple of it")
    parser.add_argument("--minutes", type=int, default=2, help="measured after the warm-up")
    parser.add_argument(
        "--warm-up",
        type=float,
        default=90.0,
        help="the most seconds to wait for the first refusal before measuring",
    )
    parser.add_argument("--redis-timeout", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--word-letters",
        type=int,
        default=3,
        choices=range(1, 7),
        help="letters per prompt word: 3 makes the gateway's estimate exact; 6 makes it 30%%"
        " high, so that every answer gives tokens back when it is settled",
    )
    args = parser.parse_args()
    runs = []
    with EmulatedReplicas(2, MODEL, ["--decode-ms-per-token", "2"]) as replicas:
        for count in (int(part) for part in args.gateways.split(",")):
            runs.append(run("one Redis", count, True, args, replicas))
            print(table(runs[-1:], args.tokens_per_minute), file=sys.stderr)
        if args.local_gateways:
            runs.append(run("each alone", args.local_gateways, False, args, replicas))
    limit, offered = args.tokens_per_minute, args.offered
    print(
        f"tokens_per_minute {limit}, offered {offered}x, {args.minutes} minutes,"
        f" {args.word_letters} letters a word"
    )
    print(table(runs, args.tokens_per_minute))


if __name__ == "__main__":
    main()
