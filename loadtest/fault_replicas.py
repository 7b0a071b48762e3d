"""Fault scenarios on the replica side: one dies, stalls, or answers badly, under load.

Each starts its own emulated replicas, fault servers (`tests/fault_servers.py`) and gateway on
loopback ports and returns the tally of every request with the facts the gateway reported.
`loadtest/faults.py` runs them and prints the table; `tests/test_faults_replicas.py` asserts.
"""

from __future__ import annotations

import asyncio
import time

from loadtest.fault_load import MODEL, Result, Tally, run_load, wait_for
from prefix_gateway.emulator.replicas import EmulatedReplicas
from tests.fault_servers import FaultServer
from tests.support import GatewayProcess, metric_value

# A healthy replica on a busy machine can take a few hundred ms to answer a probe: the timeout
# leaves it that, while the interval still finds a dead one within a second.
FAST_HEALTH = ("--health-interval", "0.2", "--health-timeout", "1.5")


def _healthy(gateway: GatewayProcess, backend: str) -> float:
    return gateway.metric("gateway_backend_healthy", backend=backend)


def _name(url: str) -> str:
    return url.removeprefix("http://")


async def replica_killed() -> Result:
    """SIGKILL one of three replicas under load, start it again on the same port."""
    args = ["--decode-ms-per-token", "4"]
    with (
        EmulatedReplicas(3, MODEL, args) as fleet,
        GatewayProcess(fleet.urls, *FAST_HEALTH, "--unhealthy-threshold", "1") as gateway,
    ):
        victim = fleet.replicas[0]
        name = _name(victim.url)
        tally, stop = Tally(), asyncio.Event()
        load = asyncio.create_task(run_load(gateway.url, 8, stop, tally, max_tokens=40))
        await asyncio.sleep(1.0)
        # Killed while it relays two streams, so that one at least (they last 160 ms) is sure
        # to break after its first byte.
        await wait_for(lambda: tally.streaming[name] >= 2, 5, 0.002)
        victim.kill()
        ejected = await wait_for(lambda: _healthy(gateway, name) == 0, 15)
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
            "in_flight_after": metric_value(text, "gateway_backend_in_flight"),
        },
    )


async def replica_stalls() -> Result:
    """One of three replicas starts accepting requests and never answering."""
    with (
        EmulatedReplicas(2, MODEL, ["--decode-ms-per-token", "2"]) as fleet,
        FaultServer() as staller,
    ):
        specs = [f"{MODEL}={url}" for url in [*fleet.urls, staller.url]]
        with GatewayProcess(
            specs, *FAST_HEALTH, "--first-byte-timeout", "2", "--failure-threshold", "3"
        ) as gateway:
            name = _name(staller.url)
            await wait_for(lambda: _healthy(gateway, name) == 1, 5)
            tally, stop = Tally(), asyncio.Event()
            load = asyncio.create_task(run_load(gateway.url, 6, stop, tally, max_tokens=10))
            await asyncio.sleep(0.5)
            staller.mode = "stall"
            began = time.monotonic()
            ejected = await wait_for(lambda: _healthy(gateway, name) == 0, 15)
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
            "all_timeouts": metric_value(text, "gateway_upstream_errors_total", cause="timeout"),
            "timeout_retries": metric_value(
                text, "gateway_upstream_retries_total", cause="timeout"
            ),
            "ejected": ejected,
            "ejected_after_s": ejected_after,
            "in_flight_after": metric_value(text, "gateway_backend_in_flight"),
        },
    )


async def replicas_misbehave() -> Result:
    """Three of five replicas answer 500, garbage, or drop the connection mid-response."""
    with (
        EmulatedReplicas(2, MODEL, ["--decode-ms-per-token", "1"]) as fleet,
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
            "in_flight_after": metric_value(text, "gateway_backend_in_flight"),
        },
    )
