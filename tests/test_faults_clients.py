"""Clients that leave, crowd in, or outlive the gateway: aborted, refused, or served to the end.

Redis going away under load is covered by tests/test_redis_fleet.py
(test_killing_redis_under_load_fails_no_request_and_sharing_resumes).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from loadtest import fault_clients
from prefix_gateway.emulator.replicas import EmulatedReplicas
from tests.conftest import MODEL
from tests.support import PATIENCE_SECONDS, GatewayProcess, wait_until
from tests.words import words


def test_clients_that_hang_up_abort_their_generation_at_once() -> None:
    result = asyncio.run(fault_clients.clients_disconnect())
    facts = result.facts
    assert facts["stopped"]
    # Every abandoned request, streamed or not, was aborted by the replica rather than generated
    # to its end, and counted by the gateway as a disconnect.
    assert facts["aborted"] == facts["hung_up"] == facts["disconnects_counted"] == 20
    assert facts["in_flight_after"] == 0


def test_overload_is_refused_with_429_and_retry_after_and_memory_stays_flat() -> None:
    result = asyncio.run(fault_clients.overload())
    tally, facts = result.tally, result.facts
    assert tally.lost == 0, tally.lost_reasons
    assert set(tally.statuses) == {200, 429}
    assert tally.statuses[200] >= 5 * 16  # the bound and the queue are served every burst
    assert facts["refused"] == facts["refused_counted"] == facts["with_retry_after"] > 0
    assert tally.ok + tally.failed == tally.sent == 1000
    # 1,000 requests refused or served, in bursts, raise the process's peak memory by less
    # than 12 MiB (5.5 to 8.5 MiB measured across builds that keep nothing per request: the
    # peak holds a burst's buffers, and where the allocator puts them moves with the code).
    assert facts["rss_growth_mib"] < 12
    assert facts["in_flight_after"] == 0


def test_sigterm_lets_every_running_stream_finish() -> None:
    result = asyncio.run(fault_clients.sigterm_during_streams())
    tally, facts = result.tally, result.facts
    assert facts["ready_after_signal"] == 503  # readiness went first
    assert tally.ok == tally.sent == 12, tally.lost_reasons
    assert facts["exited"]


def test_a_stream_outliving_the_shutdown_grace_ends_with_an_sse_error() -> None:
    args = ("--shutdown-grace", "1")
    with (
        EmulatedReplicas(1, MODEL, ["--decode-ms-per-token", "10"]) as fleet,
        GatewayProcess(fleet.urls, *args) as gateway,
    ):
        # uvicorn says so when the grace runs out with the stream still open: the point here.
        gateway.expect_log("timeout graceful shutdown exceeded")
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": words(20)}],
            "max_tokens": 400,  # four seconds
            "stream": True,
        }
        events: list[str] = []
        signalled = float("nan")
        with httpx.stream(
            "POST", gateway.url + "/v1/chat/completions", json=body, timeout=20
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data:"):
                    if not events:
                        os.kill(gateway.pid, signal.SIGTERM)
                        signalled = time.monotonic()
                    events.append(line)
        ended = time.monotonic() - signalled
        wait_until(lambda: not gateway.running, "the gateway's exit")
        log = gateway.log()
        replica = fleet.replicas[0]
        # The replica stopped generating for it.
        wait_until(
            lambda: replica.metric("vllm:request_success_total", finished_reason="abort") == 1,
            "the replica aborting the stream",
        )
    # The stream ran through the grace period, then ended with an error instead of [DONE].
    assert '"code":"shutting_down"' in events[-1]
    assert "data: [DONE]" not in events and len(events) < 400
    assert ended >= 1.0
    assert "Exception in ASGI application" not in log  # ended as planned, not as a crash


def test_new_connections_are_refused_once_the_listener_closed() -> None:
    with (
        EmulatedReplicas(1, MODEL) as fleet,
        GatewayProcess(fleet.urls, "--shutdown-delay", "5") as gateway,
    ):
        os.kill(gateway.pid, signal.SIGTERM)
        answers: list[httpx.Response] = []

        def unready() -> bool:
            answers.append(httpx.get(gateway.url + "/ready", timeout=PATIENCE_SECONDS))
            return answers[-1].status_code != 200

        wait_until(unready, "/ready turning 503")
        served = httpx.post(
            gateway.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
            timeout=PATIENCE_SECONDS,
        )
        wait_until(lambda: not gateway.running, "the gateway's exit after the delay")
        with pytest.raises(httpx.ConnectError):
            httpx.get(gateway.url + "/ready", timeout=1)
    during = answers[-1]
    assert during.status_code == 503 and during.json()["shutting_down"] is True
    assert served.status_code == 200  # still serving during the delay
