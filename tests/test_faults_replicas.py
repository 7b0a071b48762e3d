"""Replicas that die, stall or misbehave under load: failed over, cleanly failed, counted.

The scenarios live in loadtest/faults.py (which also prints docs/reliability.md's table); these
tests run them and hold the gateway to exact counts. The smaller tests pin down one rule each:
retries on 429/503, health thresholds, a stream that goes quiet.
"""

from __future__ import annotations

import asyncio
import email.utils
import time

import httpx
import openai
import pytest

from loadtest import fault_replicas
from tests.conftest import MODEL
from tests.fault_servers import FaultServer
from tests.support import GatewayProcess, metric_value, wait_until
from tests.words import words


def test_a_replica_killed_mid_run_fails_no_plain_request_and_comes_back() -> None:
    result = asyncio.run(fault_replicas.replica_killed())
    tally, facts = result.tally, result.facts
    assert tally.lost == 0, tally.lost_reasons
    assert tally.failed_plain == 0  # every non-streamed request failed over
    # Only streams already under way when the replica died fail, each with an SSE error event,
    # and the gateway counted exactly those.
    assert tally.failed == tally.failed_streams == facts["broken_streams"] >= 1
    assert tally.ok + tally.failed == tally.sent > 100
    assert facts["ejected"] and facts["readmitted"]
    assert facts["served_after_return"] > 0
    assert facts["in_flight_after"] == 0  # every lease was given back, failures included


def test_a_stalled_replica_times_out_onto_another() -> None:
    result = asyncio.run(fault_replicas.replica_stalls())
    tally, facts = result.tally, result.facts
    assert tally.lost == 0 and tally.failed == 0, tally.lost_reasons
    assert tally.ok == tally.sent > 100
    # Every request the stalled replica swallowed timed out and was retried elsewhere.
    assert facts["stalled"] >= 1
    assert facts["timeouts"] == facts["stalled"]
    assert facts["all_timeouts"] == facts["timeout_retries"]  # each retried, wherever it was
    assert facts["ejected"]
    assert facts["in_flight_after"] == 0


def test_replicas_answering_500_garbage_or_cut_responses_give_clean_counted_errors() -> None:
    result = asyncio.run(fault_replicas.replicas_misbehave())
    tally, facts = result.tally, result.facts
    assert tally.lost == 0, tally.lost_reasons
    assert set(tally.statuses) <= {200, 500}
    # A 500 is the replica's answer: relayed, counted, never retried.
    assert tally.failed_plain == tally.statuses[500] == facts["answered_500"]
    assert facts["counted_500"] == facts["answered_500"] > 0
    # Garbage and responses cut before their first byte are retried elsewhere, every one.
    assert facts["counted_garbage"] == facts["garbage"] > 0
    assert facts["counted_cut"] == facts["cut"] > 0
    assert facts["protocol_retries"] == facts["protocol_errors"] > 0
    # A stream cut after its first byte ends with an SSE error event, counted.
    assert tally.failed_streams == facts["broken_streams"] > 0
    assert tally.ok + tally.failed == tally.sent
    assert facts["in_flight_after"] == 0


def _chat(url: str, tag: object = "") -> httpx.Response:
    """A chat request; different tags spread over the replicas."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": words(20, f"t{tag}")}]}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=10)


@pytest.mark.parametrize(
    ("status", "headers", "cause"),
    [(503, {}, "status_503"), (429, {"retry-after": "0.2"}, "status_429")],
)
def test_503_and_429_move_to_the_next_candidate(
    status: int, headers: dict[str, str], cause: str
) -> None:
    with (
        FaultServer(mode="status", status=status, extra_headers=headers) as refusing,
        FaultServer() as good,
    ):
        specs = [f"{MODEL}={refusing.url}", f"{MODEL}={good.url}"]
        with GatewayProcess(specs, "--failure-threshold", "1000") as gateway:
            for attempt in range(8):
                began = time.monotonic()
                response = _chat(gateway.url, attempt)
                assert response.status_code == 200
                if response.headers["x-gateway-route"] == "retry" and status == 429:
                    assert time.monotonic() - began >= 0.2  # Retry-After was waited out
            text = gateway.metrics()
    assert refusing.posts >= 1
    assert metric_value(text, "gateway_upstream_retries_total", cause=cause) == refusing.posts


def test_a_long_retry_after_is_passed_to_the_client_and_exhausted_attempts_too() -> None:
    with (
        FaultServer(mode="status", status=429, extra_headers={"retry-after": "30"}) as slow,
        FaultServer(mode="status", status=503) as down,
    ):
        with GatewayProcess([f"{MODEL}={slow.url}"]) as gateway:
            response = _chat(gateway.url)
            assert response.status_code == 429
            assert response.headers["retry-after"] == "30"
        with GatewayProcess([f"{MODEL}={down.url}"], "--failure-threshold", "1000") as gateway:
            response = _chat(gateway.url)
            assert response.status_code == 503  # the replica's own answer, after one attempt
            assert down.posts == 1


def test_health_thresholds_eject_and_readmit() -> None:
    with FaultServer() as replica:
        args = ("--health-interval", "0.1", "--health-timeout", "1")
        thresholds = ("--unhealthy-threshold", "3", "--healthy-threshold", "3")
        with GatewayProcess([f"{MODEL}={replica.url}"], *args, *thresholds) as gateway:
            name = replica.url.removeprefix("http://")

            def healthy() -> float:
                return gateway.metric("gateway_backend_healthy", backend=name)

            assert healthy() == 1  # a starting replica is admitted by its first good probe
            replica.mode = "stall"
            probes = replica.probes
            wait_until(lambda: healthy() == 0, "the replica ejected")
            assert replica.probes - probes >= 3  # ejected only after three failed probes
            assert _chat(gateway.url).json()["error"]["code"] == "no_healthy_backend"
            replica.mode = "ok"
            probes = replica.probes
            wait_until(lambda: healthy() == 1, "the replica back")
            assert replica.probes - probes >= 3  # readmitted only after three good ones
            assert _chat(gateway.url).status_code == 200


def test_passive_ejection_after_consecutive_failures() -> None:
    with FaultServer(mode="error") as failing, FaultServer() as good:
        specs = [f"{MODEL}={failing.url}", f"{MODEL}={good.url}"]
        args = ("--failure-threshold", "3", "--health-interval", "60")
        with GatewayProcess(specs, *args) as gateway:
            for attempt in range(20):
                _chat(gateway.url, attempt)
            assert failing.posts == 3  # ejected by the third 500 in a row, long before a probe
            text = gateway.metrics()
    name = failing.url.removeprefix("http://")
    assert metric_value(text, "gateway_backend_healthy", backend=name) == 0


def test_a_stream_that_goes_quiet_ends_with_an_sse_error() -> None:
    with FaultServer(mode="quiet", cut_after=2) as quiet:
        args = ("--stream-idle-timeout", "1.5", "--failure-threshold", "1000")
        with GatewayProcess([f"{MODEL}={quiet.url}"], *args) as gateway:
            with httpx.stream(
                "POST",
                gateway.url + "/v1/chat/completions",
                json={
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "x"}],
                    "stream": True,
                },
                timeout=10,
            ) as response:
                began = time.monotonic()
                events = [line for line in response.iter_lines() if line.startswith("data:")]
                waited = time.monotonic() - began
            text = gateway.metrics()
    assert len(events) == 3
    assert '"code":"stream_idle_timeout"' in events[-1]
    assert waited > 1.4  # not before the idle timeout
    assert metric_value(text, "gateway_upstream_errors_total", cause="stream_idle") == 1
    assert metric_value(text, "gateway_requests_total", status="504") == 1


def test_the_openai_client_raises_on_a_stream_cut_after_its_first_byte() -> None:
    with (
        FaultServer(mode="cut", cut_after=2, gap=0.1) as cutter,
        GatewayProcess([f"{MODEL}={cutter.url}"]) as gateway,
    ):
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True
        )
        pieces = []
        with pytest.raises(openai.APIError, match="broke off"):
            for chunk in stream:
                pieces.append(chunk.choices[0].delta.content)
    assert pieces == ["fine0 ", "fine1 "]  # everything before the break was relayed


def test_a_retry_after_given_as_an_http_date() -> None:
    """A date already past is no wait: retried on the other replica at once; a date two
    minutes away is longer than the gateway waits: the replica's 429 goes to the client."""
    past = email.utils.formatdate(0, usegmt=True)
    later = email.utils.formatdate(time.time() + 120, usegmt=True)
    with (
        FaultServer(mode="status", status=429, extra_headers={"retry-after": past}) as ready,
        FaultServer(mode="status", status=429, extra_headers={"retry-after": later}) as busy,
        FaultServer() as good,
    ):
        specs = [f"{MODEL}={ready.url}", f"{MODEL}={good.url}"]
        with GatewayProcess(specs, "--failure-threshold", "1000") as gateway:
            for attempt in range(8):
                assert _chat(gateway.url, attempt).status_code == 200
            text = gateway.metrics()
        assert ready.posts >= 1
        assert metric_value(text, "gateway_upstream_retries_total", cause="status_429") == (
            ready.posts
        )
        with GatewayProcess([f"{MODEL}={busy.url}", f"{MODEL}={good.url}"]) as gateway:
            for attempt in range(8):
                response = _chat(gateway.url, attempt)
                if response.status_code == 429:
                    assert response.headers["retry-after"] == later
                    break
            else:
                raise AssertionError("no request was placed on the busy replica")
