"""The access log: one JSON line per request, never the prompt."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import orjson

from prefix_gateway.emulator.replicas import EmulatedReplicas
from tests.conftest import MODEL
from tests.support import PATIENCE_SECONDS, GatewayProcess, wait_until
from tests.words import words

FIELDS = {
    "ts",
    "level",
    "logger",
    "request_id",
    "endpoint",
    "model",
    "backend",
    "route",
    "status",
    "stream",
    "attempts",
    "prompt_tokens_estimated",
    "matched_tokens_estimated",
    "prompt_tokens",
    "cached_tokens",
    "affinity",
    "cache_break",
    "ttft_s",
    "duration_s",
}


def access_lines(gateway: GatewayProcess) -> list[dict[str, Any]]:
    return [
        orjson.loads(line)
        for line in gateway.log().splitlines()
        if line.startswith("{") and '"request_id"' in line
    ]


def line_for(gateway: GatewayProcess, request_id: str) -> dict[str, Any]:
    def found() -> list[dict[str, Any]]:
        return [line for line in access_lines(gateway) if line["request_id"] == request_id]

    wait_until(found, f"an access-log line for {request_id}")
    lines = found()
    assert len(lines) == 1
    return lines[0]


def test_a_line_per_request_with_the_routing_facts(
    client: openai.OpenAI, gateway: GatewayProcess
) -> None:
    prompt = words(120, "secret")
    line: dict[str, Any] = {}
    for attempt in range(2):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=3,
            extra_headers={"x-request-id": f"log-chat-{attempt}"},
        )
        usage = raw.parse().usage
        assert usage is not None and usage.prompt_tokens_details is not None
        line = line_for(gateway, f"log-chat-{attempt}")
        assert set(line) == FIELDS
        assert line["backend"] == raw.headers["x-gateway-backend"]
        assert line["route"] == raw.headers["x-gateway-route"]
        assert (line["model"], line["status"], line["endpoint"]) == (
            MODEL,
            200,
            "/v1/chat/completions",
        )
        assert line["prompt_tokens"] == usage.prompt_tokens == 120
        assert line["cached_tokens"] == usage.prompt_tokens_details.cached_tokens
        assert 0 < line["ttft_s"] <= line["duration_s"] < 10
        assert line["attempts"] == 1 and line["stream"] is False
    assert line["matched_tokens_estimated"] > 0 and line["cached_tokens"] > 0
    assert line["affinity"] == "hit"  # the same prompt again, on the same replica
    assert "secret" not in gateway.log()


def test_a_streamed_request_logs_its_first_byte(
    client: openai.OpenAI, gateway: GatewayProcess
) -> None:
    stream = client.completions.create(
        model=MODEL,
        prompt=words(40),
        max_tokens=8,
        stream=True,
        extra_headers={"x-request-id": "log-stream"},
    )
    assert sum(1 for chunk in stream if chunk.choices and chunk.choices[0].text) == 8
    line = line_for(gateway, "log-stream")
    assert line["stream"] is True and line["endpoint"] == "/v1/completions"
    assert 0 < line["ttft_s"] < line["duration_s"]


def test_a_rejected_request_is_logged_with_its_error(gateway: GatewayProcess) -> None:
    response = httpx.post(
        gateway.url + "/v1/chat/completions",
        content=b"{oops",
        headers={"x-request-id": "log-bad", "content-type": "application/json"},
        timeout=PATIENCE_SECONDS,
    )
    assert response.status_code == 400
    line = line_for(gateway, "log-bad")
    assert line["status"] == 400 and line["error"] == "invalid_json"


def test_the_access_log_can_be_turned_off(fleet: EmulatedReplicas) -> None:
    with GatewayProcess(fleet.urls, "--no-access-log") as quiet:
        response = httpx.post(
            quiet.url + "/v1/completions",
            json={"model": MODEL, "prompt": "hello", "max_tokens": 2},
            headers={"x-request-id": "log-off"},
            timeout=PATIENCE_SECONDS,
        )
        assert response.status_code == 200
        assert response.headers["x-request-id"] == "log-off"
        assert access_lines(quiet) == []
