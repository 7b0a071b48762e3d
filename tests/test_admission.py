"""Admission: slots handed over first come first served, a full queue refused at once, a wait
that runs out refused as such, a client that leaves while queued giving its place back; and
through a live gateway, both refusals as 429s with `Retry-After`."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import httpx

from prefix_gateway.emulator.replicas import EmulatedReplicas
from prefix_gateway.proxy.admission import Admission
from tests.conftest import MODEL
from tests.support import GatewayProcess, eventually, wait_until

# Longer than any test waits for a hand-over: a wait that runs out is a failure.
PATIENT = 60.0


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(scenario())


def queue(admission: Admission, name: str, entered: list[str]) -> asyncio.Task[str | None]:
    """A request waiting for a slot; `entered` records the order in which waiters get one."""

    async def wait() -> str | None:
        refused = await admission.enter()
        if refused is None:
            entered.append(name)
        return refused

    return asyncio.create_task(wait(), name=name)


def test_freed_slots_go_to_the_waiters_in_arrival_order() -> None:
    async def scenario() -> None:
        admission = Admission(limit=1, queue_limit=3, queue_timeout=PATIENT)
        assert admission.try_enter()
        entered: list[str] = []
        names = ["first", "second", "third"]
        waiters = []
        for name in names:
            waiters.append(queue(admission, name, entered))
            await eventually(lambda: admission.waiting == len(waiters), f"{name} queued")
        for position, waiter in enumerate(waiters):
            admission.leave()
            assert await waiter is None
            assert entered == names[: position + 1]
            assert admission.active == 1, "a slot passes from hand to hand, never to the pool"
        admission.leave()
        assert admission.active == 0 and admission.waiting == 0

    run(scenario)


def test_a_full_queue_refuses_at_once_and_a_wait_that_runs_out_is_a_queue_timeout() -> None:
    async def scenario() -> None:
        # Long enough that the waiter is still queued when the next one is refused.
        admission = Admission(limit=1, queue_limit=1, queue_timeout=1.0)
        assert admission.try_enter()
        entered: list[str] = []
        waiter = queue(admission, "waiting", entered)
        await eventually(lambda: admission.waiting == 1, "a waiter queued")
        assert await admission.enter() == "overloaded"
        assert await waiter == "queue_timeout"  # no slot freed while it waited
        assert admission.waiting == 0 and admission.active == 1 and entered == []
        admission.leave()
        assert admission.active == 0
        assert await Admission(limit=0, queue_limit=5, queue_timeout=0).enter() == "overloaded"

    run(scenario)


def test_a_client_that_leaves_while_queued_frees_its_place() -> None:
    async def scenario() -> None:
        admission = Admission(limit=1, queue_limit=1, queue_timeout=PATIENT)
        assert admission.try_enter()
        entered: list[str] = []
        leaving = queue(admission, "leaving", entered)
        await eventually(lambda: admission.waiting == 1, "a waiter queued")
        leaving.cancel()
        await asyncio.gather(leaving, return_exceptions=True)
        assert admission.waiting == 0
        staying = queue(admission, "staying", entered)  # the place is free again
        await eventually(lambda: admission.waiting == 1, "the next waiter queued")
        admission.leave()
        assert await staying is None
        assert entered == ["staying"] and admission.active == 1
        admission.leave()
        assert admission.active == 0

    run(scenario)


def test_a_slot_handed_to_a_waiter_that_left_goes_to_the_next() -> None:
    async def scenario() -> None:
        admission = Admission(limit=1, queue_limit=2, queue_timeout=PATIENT)
        assert admission.try_enter()
        entered: list[str] = []
        leaving = queue(admission, "leaving", entered)
        await eventually(lambda: admission.waiting == 1, "the first waiter queued")
        staying = queue(admission, "staying", entered)
        await eventually(lambda: admission.waiting == 2, "the second waiter queued")
        # The slot is handed over and its taker cancelled before it runs again.
        admission.leave()
        leaving.cancel()
        await asyncio.gather(leaving, return_exceptions=True)
        assert await staying is None
        assert entered == ["staying"]
        admission.leave()
        assert admission.active == 0 and admission.waiting == 0

    run(scenario)


def test_both_refusals_are_429s_with_retry_after_through_the_gateway() -> None:
    """One request holds the only slot, a second takes the only place in the queue and waits it
    out, a third finds the queue full: which of the two came first is not known, but one is
    `overloaded` and the other `queue_timeout` (sent together, they arrive well within the
    queue's timeout of each other)."""
    limits = ("--max-concurrency", "1", "--max-queue", "1", "--queue-timeout", "5")
    with (
        EmulatedReplicas(1, MODEL, ["--decode-ms-per-token", "100"]) as fleet,
        GatewayProcess(fleet.urls, *limits) as gateway,
    ):
        long_stream = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hold the slot"}],
            "max_tokens": 600,  # a minute
            "stream": True,
        }
        short = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
        refusals: list[httpx.Response] = []

        def refused() -> None:
            url = gateway.url + "/v1/chat/completions"
            refusals.append(httpx.post(url, json=short, timeout=60))

        with httpx.stream(
            "POST", gateway.url + "/v1/chat/completions", json=long_stream, timeout=60
        ) as holding:
            lines = holding.iter_lines()  # kept: collected, it would close the stream
            assert next(lines).startswith("data: ")
            clients = [threading.Thread(target=refused) for _ in range(2)]
            for client in clients:
                client.start()
            for client in clients:
                client.join(PATIENT)
            wait_until(lambda: len(refusals) == 2, "both requests answered")
        after = httpx.post(gateway.url + "/v1/chat/completions", json=short, timeout=60)
        counted = gateway.metric("gateway_rejected_requests_total", status="429")
    assert after.status_code == 200  # the freed slot serves again
    codes = set()
    for response in refusals:
        assert response.status_code == 429
        assert response.headers["retry-after"] == "1"
        error = response.json()["error"]
        assert error["type"] == "rate_limit_error"
        codes.add(error["code"])
    assert codes == {"overloaded", "queue_timeout"}
    assert counted == 2
