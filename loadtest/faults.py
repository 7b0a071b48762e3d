"""Fault scenarios against real processes: what clients see when things break.

Each scenario starts its own emulated replicas (and fault servers, Redis) and a gateway on
loopback ports, puts a bounded load on it, injects its fault, and returns the tally of every
request plus the facts the gateway reported. `tests/test_faults_*.py` run the same scenarios
and assert on them; this script prints the table of docs/reliability.md:

    python loadtest/faults.py
    python loadtest/faults.py --scenarios killed,overload
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.fleet import EmulatedFleet
from loadtest.fault_load import (
    MODEL,
    Tally,
    burst,
    chat_body,
    one_request,
    rss_bytes,
    run_load,
    wait_for,
)
from tests.fault_servers import FaultServer
from tests.support import GatewayProcess, metric_value

FAST_HEALTH = ("--health-interval", "0.2", "--health-timeout", "0.3")


@dataclass
class Result:
    scenario: str
    tally: Tally
    faults: str
    """What was injected, in words with counts."""
    facts: dict[str, float] = field(default_factory=dict)


def _healthy(gateway: GatewayProcess, backend: str) -> float:
    return gateway.metric("gateway_backend_healthy", backend=backend)


def _name(url: str) -> str:
    return url.removeprefix("http://")


async def replica_killed() -> Result:
    """SIGKILL one of three replicas under load, start it again on the same port."""
    args = ["--decode-ms-per-token", "4"]
    with (
        EmulatedFleet(3, MODEL, args) as fleet,
        GatewayProcess(fleet.urls, *FAST_HEALTH, "--unhealthy-threshold", "1") as gateway,
    ):
        victim = fleet.replicas[0]
        name = _name(victim.url)
        tally, stop = Tally(), asyncio.Event()
        load = asyncio.create_task(run_load(gateway.url, 8, stop, tally, max_tokens=30))
        await asyncio.sleep(1.0)
        victim.kill()
        ejected = await wait_for(lambda: _healthy(gateway, name) == 0, 5)
        await asyncio.sleep(0.5)
        await asyncio.to_thread(victim.start)
        readmitted = await wait_for(lambda: _healthy(gateway, name) == 1, 10)
        served_before = tally.backends[name]
        await asyncio.sleep(1.0)
        stop.set()
        await load
        text = gateway.metrics()
    return Result(
        "replica killed mid-run",
        tally,
        "1 replica of 3 SIGKILLed, restarted 0.5 s later",
        {
            "ejected": ejected,
            "readmitted": readmitted,
            "served_after_return": tally.backends[name] - served_before,
            "broken_streams": metric_value(
                text, "gateway_upstream_errors_total", cause="stream_broken"
            ),
            "retries": metric_value(text, "gateway_upstream_retries_total"),
        },
    )


async def replica_stalls() -> Result:
    """One of three replicas starts accepting requests and never answering."""
    with (
        EmulatedFleet(2, MODEL, ["--decode-ms-per-token", "2"]) as fleet,
        FaultServer() as staller,
    ):
        specs = [f"{MODEL}={url}" for url in [*fleet.urls, staller.url]]
        with GatewayProcess(
            specs, *FAST_HEALTH, "--first-byte-timeout", "0.5", "--failure-threshold", "3"
        ) as gateway:
            name = _name(staller.url)
            await wait_for(lambda: _healthy(gateway, name) == 1, 5)
            tally, stop = Tally(), asyncio.Event()
            load = asyncio.create_task(run_load(gateway.url, 6, stop, tally, max_tokens=10))
            await asyncio.sleep(0.5)
            staller.mode = "stall"
            began = time.monotonic()
            ejected = await wait_for(lambda: _healthy(gateway, name) == 0, 5)
            ejected_after = time.monotonic() - began
            await asyncio.sleep(1.0)
            stop.set()
            await load
            text = gateway.metrics()
    return Result(
        "replica stalls",
        tally,
        f"{staller.stalled} requests accepted and never answered by 1 replica of 3",
        {
            "stalled": staller.stalled,
            "timeouts": metric_value(
                text, "gateway_upstream_errors_total", backend=name, cause="timeout"
            ),
            "timeout_retries": metric_value(
                text, "gateway_upstream_retries_total", cause="timeout"
            ),
            "ejected": ejected,
            "ejected_after_s": ejected_after,
        },
    )


async def replicas_misbehave() -> Result:
    """Three of five replicas answer 500, garbage, or drop the connection mid-response."""
    with (
        EmulatedFleet(2, MODEL, ["--decode-ms-per-token", "1"]) as fleet,
        FaultServer(mode="error") as failing,
        FaultServer(mode="garbage") as garbage,
        FaultServer(mode="cut") as cutter,
    ):
        bad = {"error": failing, "garbage": garbage, "cut": cutter}
        specs = [f"{MODEL}={url}" for url in [*fleet.urls, *(s.url for s in bad.values())]]
        with GatewayProcess(
            specs, "--health-interval", "0.3", "--failure-threshold", "3"
        ) as gateway:
            names = {kind: _name(server.url) for kind, server in bad.items()}
            await wait_for(lambda: all(_healthy(gateway, n) == 1 for n in names.values()), 5)
            tally, stop = Tally(), asyncio.Event()
            load = asyncio.create_task(run_load(gateway.url, 6, stop, tally, max_tokens=6))
            await asyncio.sleep(2.0)
            stop.set()
            await load
            text = gateway.metrics()

    def errors(kind: str, cause: str | None = None) -> float:
        labels = {"backend": names[kind]} | ({"cause": cause} if cause else {})
        return metric_value(text, "gateway_upstream_errors_total", **labels)

    return Result(
        "replicas answer 500, garbage, or cut responses",
        tally,
        f"{failing.posts} answered 500, {garbage.posts} answered garbage, {cutter.cut} cut "
        "mid-response (3 replicas of 5)",
        {
            "answered_500": failing.posts,
            "counted_500": errors("error", "status_500"),
            "garbage": garbage.posts,
            "counted_garbage": errors("garbage"),
            "cut": cutter.cut,
            "counted_cut": errors("cut"),
            "broken_streams": errors("cut", "stream_broken"),
            "protocol_errors": metric_value(
                text, "gateway_upstream_errors_total", cause="protocol"
            ),
            "protocol_retries": metric_value(
                text, "gateway_upstream_retries_total", cause="protocol"
            ),
        },
    )


async def clients_disconnect(streams: int = 16, plain: int = 4) -> Result:
    """Clients hang up mid-generation: the replica must abort every one of them at once."""
    with (
        EmulatedFleet(1, MODEL, ["--decode-ms-per-token", "10"]) as fleet,
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
                lambda: replica.metric("vllm:num_requests_running") == streams + plain, 5
            )
            hung_up = time.monotonic()
            for response, _ in opened:
                await response.aclose()
            for task in plain_tasks:
                task.cancel()
            await asyncio.gather(*plain_tasks, return_exceptions=True)
        stopped = await wait_for(lambda: replica.metric("vllm:num_requests_running") == 0, 5, 0.005)
        abort_seconds = time.monotonic() - hung_up
        aborted = replica.metric("vllm:request_success_total", finished_reason="abort")
        disconnects = gateway.metric("gateway_client_disconnects_total")
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
        },
    )


async def overload(bursts: int = 5, size: int = 200) -> Result:
    """Bursts far above the concurrency bound: 429s with Retry-After, memory flat."""
    limits = ("--max-concurrency", "8", "--max-queue", "8", "--queue-timeout", "0.5")
    with (
        EmulatedFleet(1, MODEL, ["--decode-ms-per-token", "5"]) as fleet,
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
        EmulatedFleet(2, MODEL, ["--decode-ms-per-token", "1"]) as fleet,
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
    args = ("--shutdown-delay", "0.5", "--shutdown-grace", "10")
    with (
        EmulatedFleet(1, MODEL, ["--decode-ms-per-token", "10"]) as fleet,
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
            await asyncio.sleep(0.1)
            ready = (await client.get(gateway.url + "/ready")).status_code
            await asyncio.gather(*tasks)
            finished = time.monotonic() - signalled
            exited = await wait_for(lambda: not gateway.running, 10)
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
    with EmulatedFleet(1, MODEL) as fleet, GatewayProcess(fleet.urls) as gateway:
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


SCENARIOS: dict[str, Callable[[], Awaitable[Result]]] = {
    "killed": replica_killed,
    "stalls": replica_stalls,
    "misbehave": replicas_misbehave,
    "disconnect": clients_disconnect,
    "redis": redis_killed,
    "overload": overload,
    "fuzz": fuzzed_requests,
    "sigterm": sigterm_during_streams,
}


def print_table(results: list[Result]) -> None:
    print("| scenario | requests sent | faults injected | requests failed | requests lost |")
    print("|---|---|---|---|---|")
    for result in results:
        tally = result.tally
        print(
            f"| {result.scenario} | {tally.sent:,} | {result.faults} | {tally.failed:,} "
            f"| {tally.lost:,} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = parser.parse_args()
    results = []
    for name in args.scenarios.split(","):
        began = time.monotonic()
        result = asyncio.run(SCENARIOS[name]())
        facts = ", ".join(f"{key}={value:g}" for key, value in result.facts.items())
        print(f"{name}: {time.monotonic() - began:.1f} s; {facts}", file=sys.stderr)
        results.append(result)
    print_table(results)


if __name__ == "__main__":
    main()
