"""Limits on one request as a whole, end to end: the whole request's time
(`--request-timeout`) and the prompts one batch may hold (`--max-batch-prompts`)."""

from __future__ import annotations

import time

import httpx

from prefix_gateway.emulator.process import EmulatorProcess
from tests.fault_servers import FaultServer
from tests.support import GatewayProcess, metric_value

MODEL = "fault-model"


def test_a_stream_that_outlives_the_request_timeout_ends_with_an_sse_error() -> None:
    # The replica sends two events and then nothing: the stream idle timeout is far away, so
    # only the whole request's deadline can end it; that is no fault of the replica's.
    with FaultServer(mode="quiet", cut_after=2) as quiet:
        args = ("--request-timeout", "2", "--stream-idle-timeout", "60")
        with GatewayProcess([f"{MODEL}={quiet.url}"], *args) as gateway:
            began = time.monotonic()
            with httpx.stream(
                "POST",
                gateway.url + "/v1/chat/completions",
                json={
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "x"}],
                    "stream": True,
                },
                timeout=30,
            ) as response:
                events = [line for line in response.iter_lines() if line.startswith("data:")]
            waited = time.monotonic() - began
            text = gateway.metrics()
            healthy = gateway.metric("gateway_backend_healthy")
    assert response.status_code == 200
    assert len(events) == 3
    assert '"code":"request_timeout"' in events[-1]
    assert waited > 1.9  # not before the deadline
    assert metric_value(text, "gateway_upstream_errors_total", cause="request_timeout") == 1
    assert metric_value(text, "gateway_upstream_retries_total") == 0
    assert healthy == 1  # the replica is not blamed for the client's deadline


def test_a_batch_of_more_prompts_than_allowed_is_refused_before_any_replica() -> None:
    with EmulatorProcess() as replica:
        args = ("--max-batch-prompts", "3")
        with GatewayProcess([replica.url], *args) as gateway:

            def complete(prompts: int) -> httpx.Response:
                body = {
                    "model": "emulated-model",
                    "prompt": [f"prompt {index}" for index in range(prompts)],
                    "max_tokens": 1,
                }
                return httpx.post(gateway.url + "/v1/completions", json=body, timeout=30)

            refused = complete(4)
            assert refused.status_code == 400
            assert refused.json()["error"]["code"] == "too_many_prompts"
            assert replica.metric("vllm:request_success_total") == 0
            answered = complete(3)
            assert answered.status_code == 200
            assert len(answered.json()["choices"]) == 3
            assert replica.metric("vllm:request_success_total") > 0  # the count that stayed 0
