"""The proxy surface, end to end with the official client and raw HTTP."""

from __future__ import annotations

import itertools

import httpx
import openai
import pytest

from prefix_gateway.emulator.replicas import EmulatedReplicas
from prefix_gateway.processes import free_port
from tests.conftest import MODEL
from tests.support import PATIENCE_SECONDS, GatewayProcess, metric_value, stall, wait_until
from tests.words import words


def test_chat_carries_the_routing_headers(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": words(30)}], max_tokens=4
    )
    reply = raw.parse()
    assert reply.choices[0].message.content
    assert raw.headers["x-gateway-route"] in ("hash", "owner", "prefix", "overflow")
    assert raw.headers["x-gateway-backend"].startswith("127.0.0.1:")
    assert raw.headers["x-request-id"]


def test_chat_stream_relays_every_chunk_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": words(40)}],
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces: list[str] = []
    usage = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert len(pieces) == 12
    assert usage is not None and usage.completion_tokens == 12


def test_completions_plain_and_streamed(client: openai.OpenAI) -> None:
    prompt = words(64)
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5)
    assert reply.choices[0].text
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == 48  # 3 of 4 blocks; one recomputed
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, stream=True))
    assert sum(1 for chunk in chunks if chunk.choices and chunk.choices[0].text) == 6


def test_models_and_embeddings(client: openai.OpenAI) -> None:
    assert [model.id for model in client.models.list()] == [MODEL]
    vectors = client.embeddings.create(model=MODEL, input=["one", "two"])
    assert len(vectors.data) == 2 and vectors.data[0].embedding


def test_stream_chunks_are_relayed_while_the_replica_still_generates() -> None:
    """Every chunk the replica has sent reaches the client while the replica sends nothing more:
    a gateway that held chunks back would leave the client waiting for them."""
    with (
        EmulatedReplicas(1, MODEL, ["--decode-ms-per-token", "20"]) as single,
        GatewayProcess(single.urls) as gateway,
    ):
        replica = single.replicas[0]
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": words(30)}],
            "max_tokens": 3000,  # a minute of decoding
            "stream": True,
        }
        with httpx.stream(
            "POST", gateway.url + "/v1/chat/completions", json=body, timeout=30
        ) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            tokens = (line for line in response.iter_lines() if line.startswith('data: {"id"'))
            for _ in range(3):
                next(tokens)
            stall(replica, True)
            produced = int(replica.metric("vllm:generation_tokens_total"))
            assert replica.metric("vllm:num_requests_running") == 1
            assert replica.metric("vllm:request_success_total", finished_reason="length") == 0
            # The replica now produces nothing: the rest of what it did produce must come.
            received = 3 + sum(1 for _ in itertools.islice(tokens, produced - 3))
            assert received == produced
            assert replica.metric("vllm:generation_tokens_total") == produced
            stall(replica, False)
        wait_until(
            lambda: replica.metric("vllm:request_success_total", finished_reason="abort") == 1,
            "the replica aborting the stream its client left",
        )


BAD_REQUESTS = [
    (b"{oops", 400, "invalid_json"),
    (b'{"messages": [{"role": "user", "content": "x"}]}', 400, "missing_model"),
    (b'{"model": "m", "messages": "x"}', 400, "invalid_messages"),
    (
        b'{"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}',
        404,
        "model_not_found",
    ),
]


@pytest.mark.parametrize(("body", "status", "code"), BAD_REQUESTS)
def test_bad_input_gets_an_openai_error(
    gateway: GatewayProcess, body: bytes, status: int, code: str
) -> None:
    response = httpx.post(
        gateway.url + "/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json"},
        timeout=PATIENCE_SECONDS,
    )
    assert response.status_code == status
    error = response.json()["error"]
    assert error["code"] == code
    assert set(error) == {"message", "type", "param", "code"}


def test_unknown_model_through_the_client(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_unknown_path_and_method_are_openai_errors(gateway: GatewayProcess) -> None:
    missing = httpx.get(gateway.url + "/v1/nothing", timeout=PATIENCE_SECONDS)
    assert missing.status_code == 404 and "error" in missing.json()
    wrong = httpx.get(gateway.url + "/v1/chat/completions", timeout=PATIENCE_SECONDS)
    assert wrong.status_code == 405 and "error" in wrong.json()


def test_metrics_count_routes_and_tokens(client: openai.OpenAI, gateway: GatewayProcess) -> None:
    client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": words(80)}], max_tokens=2
    )
    text = gateway.metrics()
    assert metric_value(text, "gateway_requests_total", model=MODEL, status="200") >= 1
    assert metric_value(text, "gateway_upstream_prompt_tokens_total", model=MODEL) >= 80
    assert metric_value(text, "gateway_routing_decision_seconds_count") >= 1
    assert metric_value(text, "gateway_backend_healthy") == 4


def test_no_healthy_backend_is_a_503() -> None:
    dead = f"{MODEL}=http://127.0.0.1:{free_port()}"
    with GatewayProcess([dead]) as lonely:
        response = httpx.post(
            lonely.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
            timeout=PATIENCE_SECONDS,
        )
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "no_healthy_backend"
        # It can still answer (that 503), so it stays ready; only the stricter question fails.
        ready = httpx.get(lonely.url + "/ready", timeout=PATIENCE_SECONDS)
        assert ready.status_code == 200
        assert ready.json() == {"ready": True, "healthy": 0, "backends": 1}
        strict = httpx.get(
            lonely.url + "/ready", params={"require_backend": "true"}, timeout=PATIENCE_SECONDS
        )
        assert strict.status_code == 503 and strict.json()["ready"] is False
        wrong = httpx.get(
            lonely.url + "/ready", params={"require_backend": "perhaps"}, timeout=PATIENCE_SECONDS
        )
        assert wrong.status_code == 400
        assert wrong.json()["error"]["code"] == "invalid_request"


def test_a_dead_replica_is_failed_over_before_the_first_byte() -> None:
    with (
        EmulatedReplicas(2, MODEL) as pair,
        GatewayProcess(pair.urls, "--health-interval", "60") as gateway,
    ):
        pair.replicas[1].stop()  # dies after its last probe: still a candidate
        statuses = []
        for attempt in range(12):
            response = httpx.post(
                gateway.url + "/v1/chat/completions",
                json={
                    "model": MODEL,
                    "max_tokens": 2,
                    "messages": [{"role": "user", "content": words(10, f"fo{attempt}")}],
                },
                timeout=PATIENCE_SECONDS,
            )
            statuses.append(response.status_code)
        assert statuses == [200] * 12
        text = gateway.metrics()
        assert metric_value(text, "gateway_upstream_retries_total", cause="connect") >= 1
        assert metric_value(text, "gateway_backend_healthy") == 1


def test_expect_100_continue_gets_the_replicas_answer(gateway: GatewayProcess) -> None:
    # curl sends `Expect: 100-continue` with larger bodies. The gateway answers the interim
    # 100 itself; the replica, which gets the body at once, must not be asked for one, or its
    # `100 Continue` came back as the response (on a reused upstream connection).
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    with httpx.Client(base_url=gateway.url, timeout=10) as http:
        for expect in ({}, {"expect": "100-continue"}, {"expect": "100-continue"}):
            response = http.post("/v1/chat/completions", json=body, headers=expect)
            assert response.status_code == 200
            assert response.json()["object"] == "chat.completion"
