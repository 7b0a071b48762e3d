"""Responses API conversations through the gateway, against a load balancer without affinity.

Four emulated replicas (no prefill or decode delay: only the cache matters here) and
`--conversations` conversations of `--turns` turns, eight at a time, all with the same
instructions (about 80 tokens), each turn asking about 70 tokens and answered in 16; every
run's text is its own, so no run finds what an earlier one cached. A conversation
carries its history one of two ways:

- `stored`: each turn names the previous response with `previous_response_id` (`store: true`,
  the OpenAI default); only the replica that stored it can answer.
- `resent`: each turn sends the whole history as input items (`store: false`), the way the
  Agents SDK does without server state.

Routers: the gateway with its `prefix` policy, the gateway with `round_robin` (the replica of a
stored response still wins over the policy), and round robin straight over the replicas (a
plain load balancer). One row per router and history: follow-ups that failed, the input
tokens the replicas report and found cached, and the spread of requests over the replicas
(the most any replica answered over the mean).

    python loadtest/responses_chains.py
    python loadtest/responses_chains.py --conversations 64 --turns 8
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prefix_gateway.emulator.replicas import EmulatedReplicas
from tests.support import GatewayProcess
from tests.words import words

MODEL = "emulated-model"
INSTRUCTIONS = "You answer questions about the hardware shop, naming the aisle. " * 6
CONCURRENCY = 8
QUESTION_TOKENS = 64


@dataclass
class Tally:
    follow_ups: int = 0
    failed: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    statuses: dict[int, int] = field(default_factory=dict)


class Targets:
    """Where each request goes: the gateway, or the replicas in turn."""

    def __init__(self, urls: list[str]) -> None:
        self._turn = itertools.cycle(urls)

    def next(self) -> str:
        return next(self._turn)


async def conversation(
    client: httpx.AsyncClient, targets: Targets, run_id: str, number: int, turns: int, stored: bool
) -> Tally:
    tally = Tally()
    history: list[dict[str, Any]] = []
    previous: str | None = None
    for turn in range(turns):
        # Each run's text its own: the fleet keeps what earlier runs cached.
        asked = f"{run_id} conversation {number} turn {turn}: {words(QUESTION_TOKENS, 'q')}"
        question = {"role": "user", "content": asked}
        body: dict[str, Any] = {
            "model": MODEL,
            "instructions": f"{run_id}. {INSTRUCTIONS}",
            "max_output_tokens": 16,
            "store": stored,
        }
        if stored:
            body["input"] = [question]
            if previous is not None:
                body["previous_response_id"] = previous
        else:
            history.append(question)
            body["input"] = history
        reply = await client.post(targets.next() + "/v1/responses", json=body)
        tally.statuses[reply.status_code] = tally.statuses.get(reply.status_code, 0) + 1
        if turn > 0:
            tally.follow_ups += 1
        if reply.status_code != 200:
            tally.failed += 1
            break  # the conversation cannot go on without its history
        response = reply.json()
        previous = response["id"]
        history.extend(response["output"])
        usage = response["usage"]
        tally.input_tokens += usage["input_tokens"]
        tally.cached_tokens += usage["input_tokens_details"]["cached_tokens"]
    return tally


async def run(targets: Targets, run_id: str, conversations: int, turns: int, stored: bool) -> Tally:
    gate = asyncio.Semaphore(CONCURRENCY)
    total = Tally()
    async with httpx.AsyncClient(timeout=60) as client:

        async def one(number: int) -> Tally:
            async with gate:
                return await conversation(client, targets, run_id, number, turns, stored)

        for tally in await asyncio.gather(*(one(number) for number in range(conversations))):
            total.follow_ups += tally.follow_ups
            total.failed += tally.failed
            total.input_tokens += tally.input_tokens
            total.cached_tokens += tally.cached_tokens
            for status, count in tally.statuses.items():
                total.statuses[status] = total.statuses.get(status, 0) + count
    return total


def answered(fleet: EmulatedReplicas) -> list[float]:
    """Requests each replica has answered so far."""
    return [replica.metric("vllm:request_success_total") for replica in fleet.replicas]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    args = parser.parse_args()
    emulator_args = ["--prefill-us-per-token", "0", "--decode-ms-per-token", "0"]
    print(f"{args.conversations} conversations of {args.turns} turns, 4 emulated replicas\n")
    print(
        "| router | history | follow-ups | failed | statuses | input tokens | cached tokens "
        "| hit rate | max/mean req |"
    )
    print("|" + "---|" * 9)
    with EmulatedReplicas(4, MODEL, emulator_args) as fleet:
        runs = itertools.count(1)
        for router in ("gateway prefix", "gateway round_robin", "direct round robin"):
            with contextlib.ExitStack() as stack:
                if router.startswith("gateway"):
                    policy = router.split()[1]
                    gateway = stack.enter_context(GatewayProcess(fleet.urls, "--policy", policy))
                    urls = [gateway.url]
                else:
                    urls = fleet.urls
                for stored in (True, False):
                    before = answered(fleet)
                    tally = asyncio.run(
                        run(
                            Targets(urls),
                            f"Run {next(runs)}",
                            args.conversations,
                            args.turns,
                            stored,
                        )
                    )
                    counts = [now - then for now, then in zip(answered(fleet), before, strict=True)]
                    spread = max(counts) / (sum(counts) / len(counts)) if sum(counts) else 0
                    statuses = ", ".join(f"{s}: {n}" for s, n in sorted(tally.statuses.items()))
                    rate = tally.cached_tokens / tally.input_tokens if tally.input_tokens else 0
                    print(
                        f"| {router} | {'stored' if stored else 'resent'} | {tally.follow_ups} "
                        f"| {tally.failed} | {statuses} | {tally.input_tokens:,} "
                        f"| {tally.cached_tokens:,} | {rate:.1%} | {spread:.2f} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
