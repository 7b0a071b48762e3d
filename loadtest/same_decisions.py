"""Whether two checkouts route alike: the same request sequence through each one's `Router`,
in process, with a fake clock, six requests in flight, answers recorded and every fifth reply
reporting nothing cached (so the cache feedback prunes). Prints how many requests were routed,
a digest of every (backend, route, matched blocks) decided, and the routes' counts: two
checkouts that decide alike print the same lines.

    python loadtest/same_decisions.py .            # this checkout
    python loadtest/same_decisions.py ../base      # another one (run it from anywhere)

A checkout from before the `Placement` (6cb408e and older) is driven through its own API
(`Router.learn`, the `in_flight` setter).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import sys
from collections import Counter
from typing import Any

CHECKOUT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else ".")
sys.path.insert(0, CHECKOUT)

import orjson  # noqa: E402

from prefix_gateway.backends.backend import Backend  # noqa: E402
from prefix_gateway.backends.pool import BackendPool  # noqa: E402
from prefix_gateway.config import Settings  # noqa: E402
from prefix_gateway.metrics import Metrics  # noqa: E402
from prefix_gateway.prompt.parsing import Endpoint, parse_request  # noqa: E402
from prefix_gateway.routing.policies import build_policy  # noqa: E402
from prefix_gateway.routing.router import Router  # noqa: E402
from prefix_gateway.routing.types import Outcome  # noqa: E402
from prefix_gateway.state.index import InMemoryPrefixIndex  # noqa: E402
from prefix_gateway.state.sessions import InMemorySessionStore  # noqa: E402
from prefix_gateway.workloads import build_workload  # noqa: E402

PLACEMENT = os.path.exists(os.path.join(CHECKOUT, "prefix_gateway", "routing", "placement.py"))
IN_FLIGHT = 6


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def build(settings: Settings, clock: FakeClock) -> tuple[Router, BackendPool]:
    pool = BackendPool.from_specs(settings.backend)
    for backend in pool.backends:
        pool.set_health(backend, True)
    index = InMemoryPrefixIndex(settings.affinity_ttl, settings.index_max_blocks, clock)
    sessions = InMemorySessionStore(settings.affinity_ttl, settings.session_max, clock)
    policy = build_policy(settings, random.Random(7))
    make: Any = Router
    if PLACEMENT:
        from prefix_gateway.routing.recorder import Stores

        return make(settings, pool, Stores(index, sessions), policy, Metrics(), clock=clock), pool
    return make(settings, pool, index, sessions, policy, Metrics(), clock=clock), pool


def lease(backend: Backend, step: int) -> None:
    held: Any = backend
    if PLACEMENT:
        (held.leased if step > 0 else held.released)()
    else:
        held.in_flight += step


def answer_of(number: int) -> str:
    return f"answer {number} " + "word " * (number % 40)


async def settle(router: Any, settings: Settings, routed: Any, number: int) -> None:
    name = routed.backend.name
    cached = routed.decision.matched_blocks * settings.block_tokens if number % 5 else 0
    prompt_tokens = round(len(routed.request.canonical) / settings.chars_per_token)
    fields: dict[str, Any] = {"accepted": (name,)} if PLACEMENT else {}
    outcome = Outcome(
        200, routed.decision, (name,), prompt_tokens, cached, answer_of(number), 0.0, **fields
    )
    if PLACEMENT:
        await routed.settle(outcome)
    else:
        routed.accepted(name)
        await router.learn(routed, outcome)
    lease(routed.backend, -1)


async def main() -> None:
    settings = Settings(backend=tuple(f"m=http://r{index}:1" for index in range(4)))
    clock = FakeClock()
    router, _ = build(settings, clock)
    decided: list[tuple[str, str, int]] = []
    flight: list[tuple[Any, int]] = []
    number = 0
    for workload in ("mixed", "customers", "conversation"):
        for session in build_workload(workload, 3):
            history = [{"role": "system", "content": session.system}]
            for question in session.questions:
                history.append({"role": "user", "content": question})
                body = orjson.dumps({"model": "m", "messages": history})
                routed: Any = await router.route(parse_request(Endpoint.CHAT, body, None))
                lease(routed.backend, 1)
                decision = routed.decision
                decided.append((decision.backend, decision.route.value, decision.matched_blocks))
                flight.append((routed, number))
                history.append({"role": "assistant", "content": answer_of(number)})
                number += 1
                clock.now += 0.05
                if len(flight) > IN_FLIGHT:
                    await settle(router, settings, *flight.pop(0))
    for routed, routed_number in flight:
        await settle(router, settings, routed, routed_number)
    print(len(decided), hashlib.sha256(repr(decided).encode()).hexdigest()[:16])
    print(dict(sorted(Counter(route for _, route, _ in decided).items())))


if __name__ == "__main__":
    asyncio.run(main())
