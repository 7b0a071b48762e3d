"""The fleet benchmark's clients: the workloads they send, to which gateway, and what they
count of the answers (`loadtest/fleet_bench.py`)."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import httpx

from prefix_gateway.workloads import Session, build_workload, text

MODEL = "bench-model"


@dataclass
class Tally:
    prompt: int = 0
    cached: int = 0
    requests: int = 0
    failed: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    """Failed requests by status code or exception."""
    per_replica: dict[str, int] = field(default_factory=dict)
    routes: dict[str, int] = field(default_factory=dict)
    holders: dict[str, set[str]] = field(default_factory=dict)
    """Per system prompt, every replica that served a request carrying it."""
    later_turns: int = 0
    moved: int = 0
    """Later turns of a conversation served by another replica than the turn before."""
    moved_routes: dict[str, int] = field(default_factory=dict)
    """The moved turns by the route that moved them."""
    new_copies: dict[str, int] = field(default_factory=dict)
    """Requests that put a system prompt on a replica other than its first holder, by route."""
    misses: dict[str, int] = field(default_factory=dict)
    """First turns that found less than half their prompt cached: the prompt's `first`
    request, a `new copy`, or `at a holder` (evicted there, or still being computed)."""
    latencies: list[float] = field(default_factory=list)

    def fail(self, why: str) -> None:
        self.failed += 1
        self.failures[why] = self.failures.get(why, 0) + 1

    def copies(self) -> float:
        """Replicas per system prompt: how many computed each, on average."""
        return sum(map(len, self.holders.values())) / max(1, len(self.holders))

    def balance(self, replicas: int) -> float:
        """Max over mean requests per replica (replicas that got none count in the mean)."""
        mean = sum(self.per_replica.values()) / replicas
        return max(self.per_replica.values(), default=0) / mean if mean else 0.0


def customer_prompts(seed: int, scale: float = 1.0) -> list[Session]:
    """96 per-customer prompts of about 1,000 tokens, Zipf-popular (s = 0.8), one ~100-token
    question per request, 600 requests at scale 1."""
    rng = random.Random(f"customer-prompts:{seed}")
    prompts = [text(rng, 1000) for _ in range(96)]
    weights = [1.0 / (rank + 1) ** 0.8 for rank in range(len(prompts))]
    chosen = rng.choices(prompts, weights=weights, k=round(600 * scale))
    return [Session("customer-prompts", system, (text(rng, 100),), 16) for system in chosen]


def sessions_of(workload: str, seed: int, scale: float) -> list[Session]:
    if workload == "customer-prompts":
        return customer_prompts(seed, scale)
    return build_workload(workload, seed, scale)


@dataclass
class Sending:
    """Where each request goes: `session` rotates a session's requests from its own number;
    `request` sends every request to the next gateway in turn, streamed."""

    urls: Sequence[str]
    rotation: str = "session"
    _turns: Iterator[int] = field(default_factory=itertools.count)

    def url(self, number: int, turn: int) -> str:
        if self.rotation == "request":
            return self.urls[next(self._turns) % len(self.urls)]
        return self.urls[(number + turn) % len(self.urls)]


async def _post(
    http: httpx.AsyncClient, url: str, body: dict[str, object], stream: bool
) -> tuple[httpx.Response, str, dict[str, object]]:
    """The response, the answer's text and its usage (streamed with usage when `stream`)."""
    if not stream:
        response = await http.post(url, json=body)
        if response.status_code != 200:
            return response, "", {}
        reply = response.json()
        return response, reply["choices"][0]["message"]["content"], reply["usage"]
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    parts: list[str] = []
    usage: dict[str, object] = {}
    async with http.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return response, "", {}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            for choice in chunk.get("choices") or ():
                parts.append(choice.get("delta", {}).get("content") or "")
            usage = chunk.get("usage") or usage
    return response, "".join(parts), usage


async def _session(
    http: httpx.AsyncClient,
    session: Session,
    number: int,
    sending: Sending,
    tally: Tally,
    think: float,
) -> None:
    messages: list[dict[str, str]] = [{"role": "system", "content": session.system}]
    previous = ""
    stream = sending.rotation == "request"
    for turn, question in enumerate(session.questions):
        messages.append({"role": "user", "content": question})
        body = {"model": MODEL, "messages": messages, "max_tokens": session.max_tokens}
        url = sending.url(number, turn)
        began = time.perf_counter()
        try:
            response, answer, usage = await _post(http, url + "/v1/chat/completions", body, stream)
        except httpx.HTTPError as error:
            tally.fail(type(error).__name__)
            return
        if response.status_code != 200:
            shown = response.text[:80].replace("|", "/").replace("\n", " ")
            tally.fail(f"{response.status_code} {shown}")
            return
        tally.latencies.append(time.perf_counter() - began)
        backend = response.headers["x-gateway-backend"]
        route = response.headers["x-gateway-route"]
        tally.per_replica[backend] = tally.per_replica.get(backend, 0) + 1
        tally.routes[route] = tally.routes.get(route, 0) + 1
        holders = tally.holders.setdefault(session.system, set())
        where = "at a holder" if backend in holders else "new copy" if holders else "first"
        if where == "new copy":
            tally.new_copies[route] = tally.new_copies.get(route, 0) + 1
        holders.add(backend)
        if turn > 0:
            tally.later_turns += 1
            if backend != previous:
                tally.moved += 1
                tally.moved_routes[route] = tally.moved_routes.get(route, 0) + 1
        previous = backend
        tally.requests += 1
        details = usage.get("prompt_tokens_details")
        tally.prompt += int(usage["prompt_tokens"])  # type: ignore[call-overload]
        cached = int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0
        tally.cached += cached
        if turn == 0 and 2 * cached < int(usage["prompt_tokens"]):  # type: ignore[call-overload]
            tally.misses[where] = tally.misses.get(where, 0) + 1
        messages.append({"role": "assistant", "content": answer})
        await asyncio.sleep(think)


async def drive(
    urls: Sequence[str],
    sessions: list[Session],
    concurrency: int,
    think: float,
    rotation: str = "session",
) -> Tally:
    """Every session once, `concurrency` at a time, their starts staggered by 50 ms, `think`
    seconds after each answer before the next request."""
    tally = Tally()
    sending = Sending(urls, rotation)
    queue = list(enumerate(sessions))
    queue.reverse()
    limits = httpx.Limits(max_connections=concurrency * len(urls))
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:

        async def worker(position: int) -> None:
            await asyncio.sleep(position * 0.05)
            while queue:
                number, session = queue.pop()
                await _session(http, session, number, sending, tally, think)

        await asyncio.gather(*(worker(position) for position in range(concurrency)))
    return tally
