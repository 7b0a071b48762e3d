"""Fault scenarios on the client and process side: clients that leave or crowd in, malformed
input, Redis going away, and SIGTERM with streams running.

Each starts its own processes on loopback ports and returns the tally of every request with the
facts it measured. `loadtest/faults.py` runs them and prints the table;
`tests/test_faults_clients.py` and `tests/test_faults_fuzz.py` assert.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx

from loadtest.fault_load import (
    MODEL,
    Result,
    Tally,
    burst,
    chat_body,
    one_request,
    rss_bytes,
    run_load,
    wait_for,
)
from prefix_gateway.emulator.replicas import EmulatedReplicas
from tests.support import GatewayProcess


async def clients_disconnect(streams: int = 16, plain: int = 4) -> Result:
    """Clients hang up mid-generation: the replica must abort every one of them at once."""
    with (
        EmulatedReplicas(1, MODEL, ["--decode-ms-per-token", "10"]) as fleet,
        GatewayProcess(fleet.urls) as gateway,
    ):
        replica = fleet.replicas[0]
        tally = Tally()
        limits = httpx.Limits(max_connections=streams + plain)
        async with httpx.AsyncClient(timeout=30, limits=limits) as client:
            opened = []
            for index in range(streams):
                body = chat_body(f"d{index}", True, max_tokens=500)
                request = client.build_request(
                    "POST", gateway.url + "/v1/chat/completions", json=body
                )
                response = await client.send(request, stream=True)
                lines = response.aiter_lines()
                read = 0
                while read < 3:
                    if (await anext(lines)).startswith("data:"):
                        read += 1
                # The line iterator is kept too: collected, it would close the stream early.
                opened.append((response, lines))
                tally.sent += 1
            plain_tasks = [
                asyncio.create_task(
                    one_request(client, gateway.url, chat_body(f"p{i}", False, 500), Tally())
                )
                for i in range(plain)
            ]
            await wait_for(
                lambda: replica.metric("vllm:num_requests_running") == streams + plain, 30
            )
            hung_up = time.monotonic()
            for response, _ in opened:
                await response.aclose()
            for task in plain_tasks:
                task.cancel()
            await asyncio.gather(*plain_tasks, return_exceptions=True)
        # 500 tokens take 5 s: a request that was not aborted ends as "length" meanwhile.
        stopped = await wait_for(
            lambda: replica.metric("vllm:num_requests_running") == 0, 30, 0.005
        )
        abort_seconds = time.monotonic() - hung_up
        aborted = replica.metric("vllm:request_success_total", finished_reason="abort")
        disconnects = gateway.metric("gateway_client_disconnects_total")
        in_flight = gateway.metric("gateway_backend_in_flight")
    tally.sent += plain
    return Result(
        "clients disconnect mid-stream",
        tally,
        f"{streams} streams and {plain} plain requests abandoned by their clients",
        {
            "hung_up": streams + plain,
            "aborted": aborted,
            "disconnects_counted": disconnects,
            "stopped": stopped,
            "abort_seconds": abort_seconds,
            "in_flight_after": in_flight,
        },
    )


async def overload(bursts: int = 5, size: int = 200) -> Result:
    """Bursts far above the concurrency bound: 429s with Retry-After, memory flat."""
    # A queue timeout no busy machine reaches: every queued request is served.
    limits = ("--max-concurrency", "8", "--max-queue", "8", "--queue-timeout", "30")
    with (
        EmulatedReplicas(1, MODEL, ["--decode-ms-per-token", "5"]) as fleet,
        GatewayProcess(fleet.urls, *limits) as gateway,
    ):
        await burst(gateway.url, size, Tally(), max_tokens=20, tag="warm")
        baseline = rss_bytes(gateway.pid)
        refused_before = gateway.metric("gateway_rejected_requests_total", status="429")
        tally = Tally()
        peak = baseline
        for round_ in range(bursts):
            await burst(gateway.url, size, tally, max_tokens=20, tag=f"r{round_}")
            peak = max(peak, rss_bytes(gateway.pid))
        rejected = gateway.metric("gateway_rejected_requests_total", status="429") - refused_before
        running = gateway.metric("gateway_backend_in_flight")
    return Result(
        "overload",
        tally,
        f"{bursts} bursts of {size} concurrent requests against --max-concurrency 8 --max-queue 8",
        {
            "refused": tally.statuses[429],
            "refused_counted": rejected,
            "with_retry_after": tally.retry_after,
            "rss_growth_mib": (peak - baseline) / 2**20,
            "in_flight_after": running,
        },
    )


async def redis_killed() -> Result:
    """Redis, shared by two gateways, is killed under load and started again."""
    from tests.redis_server import RedisServer

    with (
        RedisServer() as redis,
        EmulatedReplicas(2, MODEL, ["--decode-ms-per-token", "1"]) as fleet,
        GatewayProcess(fleet.urls, "--redis-url", redis.url) as first,
        GatewayProcess(fleet.urls, "--redis-url", redis.url) as second,
    ):
        tally, stop = Tally(), asyncio.Event()
        loads = [
            asyncio.create_task(run_load(gateway.url, 3, stop, tally, tag=f"g{index}"))
            for index, gateway in enumerate((first, second))
        ]
        await asyncio.sleep(1.0)
        redis.kill()
        await asyncio.sleep(1.5)
        redis.start()
        await asyncio.sleep(1.0)
        stop.set()
        await asyncio.gather(*loads)
        fallbacks = sum(g.metric("gateway_redis_fallbacks_total") for g in (first, second))
    return Result(
        "Redis killed",
        tally,
        "the shared redis-server SIGKILLed for 1.5 s",
        {"fallbacks": fallbacks},
    )


async def sigterm_during_streams(streams: int = 12) -> Result:
    """SIGTERM while streams run: /ready turns 503, every stream still completes."""
    args = ("--shutdown-delay", "5", "--shutdown-grace", "30")
    with (
        EmulatedReplicas(1, MODEL, ["--decode-ms-per-token", "10"]) as fleet,
        GatewayProcess(fleet.urls, *args) as gateway,
    ):
        tally = Tally()
        started = asyncio.Event()
        limits = httpx.Limits(max_connections=streams + 2)
        async with httpx.AsyncClient(timeout=30, limits=limits) as client:
            first_chunks = 0

            async def stream(index: int) -> None:
                nonlocal first_chunks
                tally.sent += 1
                body = chat_body(f"s{index}", True, max_tokens=150)
                last = ""
                try:
                    async with client.stream(
                        "POST", gateway.url + "/v1/chat/completions", json=body
                    ) as response:
                        async for line in response.aiter_lines():
                            if line.startswith("data:"):
                                if not last:
                                    first_chunks += 1
                                    if first_chunks == streams:
                                        started.set()
                                last = line[5:].strip()
                except httpx.HTTPError as error:
                    tally.lost += 1
                    tally.lost_reasons.append(repr(error))
                    return
                if last == "[DONE]":
                    tally.ok += 1
                else:
                    tally.failed += 1

            tasks = [asyncio.create_task(stream(index)) for index in range(streams)]
            await asyncio.wait_for(started.wait(), 10)
            signalled = time.monotonic()
            os.kill(gateway.pid, signal.SIGTERM)
            ready = 200
            while ready == 200:  # the listener stays open through the delay
                await asyncio.sleep(0.01)
                ready = (await client.get(gateway.url + "/ready")).status_code
            await asyncio.gather(*tasks)
            finished = time.monotonic() - signalled
            exited = await wait_for(lambda: not gateway.running, 30)
    return Result(
        "SIGTERM during streams",
        tally,
        f"SIGTERM with {streams} streams running (1.5 s each)",
        {"ready_after_signal": ready, "streams_done_s": finished, "exited": exited},
    )


async def fuzzed_requests(examples: int = 500) -> Result:
    """Malformed bodies, headers, encodings and methods at every endpoint (hypothesis)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from tests.test_faults_fuzz import METHODS, PATHS, bodies, headers

    tally = Tally()
    with EmulatedReplicas(1, MODEL) as fleet, GatewayProcess(fleet.urls) as gateway:
        with httpx.Client(base_url=gateway.url, timeout=30) as client:

            @settings(
                max_examples=examples,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            @given(st.sampled_from(METHODS), st.sampled_from(PATHS), bodies, headers)
            def send(method: str, path: str, body: bytes, extra: dict[str, bytes]) -> None:
                tally.sent += 1
                try:
                    response = client.request(method, path, content=body, headers=extra)
                except httpx.HTTPError as error:
                    tally.lost += 1
                    tally.lost_reasons.append(repr(error))
                    return
                tally.statuses[response.status_code] += 1
                if response.status_code >= 500:
                    tally.failed += 1
                else:
                    tally.ok += 1

            await asyncio.to_thread(send)
        alive = gateway.running
    rejected = sum(count for status, count in tally.statuses.items() if 400 <= status < 500)
    return Result(
        "fuzzing (hypothesis)",
        tally,
        f"{rejected} malformed requests (bodies, headers, encodings, methods)",
        {"answered_4xx": rejected, "answered_5xx": tally.failed, "alive": alive},
    )
