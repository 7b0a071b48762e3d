"""Anthropic's Messages API through the gateway, driven by the official `anthropic` client:
two emulated replicas and the gateway as real processes (one gateway for the module, with a
client key), plus a misbehaving replica that shows what a replica is sent and how a broken
stream ends. The pieces that read Messages bodies and events are checked on their own first.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import orjson
import pytest
import yaml

from prefix_gateway.auth import tenant_of
from prefix_gateway.emulator.replicas import EmulatedReplicas
from prefix_gateway.errors import BadRequest
from prefix_gateway.prompt.canonical import message_segment
from prefix_gateway.prompt.messages_api import chat_messages, tool_use_field
from prefix_gateway.prompt.parsing import Endpoint, parse_request, session_hash
from prefix_gateway.proxy.usage import StreamObserver, observe_body
from tests.conftest import MODEL
from tests.fault_servers import FaultServer
from tests.support import PATIENCE_SECONDS, GatewayProcess, metric_value, wait_until
from tests.words import words

KEY = "messages-key"
SYSTEM = "You answer questions about the shop's tools and paint in one short line. " * 8
WEATHER: Any = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def messages_body(**fields: Any) -> bytes:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    return orjson.dumps(body | fields)


# -- the body as routing sees it -------------------------------------------------------------


def test_a_conversation_resent_whole_extends_the_previous_prompt_and_answer() -> None:
    call = {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}}
    first = [{"role": "user", "content": [{"type": "text", "text": "weather?"}]}]
    answer = [{"type": "text", "text": "Let me look."}, call]
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}
    second = [
        *first,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": [result]},
    ]
    blocks = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    turn1 = parse_request(Endpoint.MESSAGES, messages_body(system=blocks, messages=first), None)
    turn2 = parse_request(Endpoint.MESSAGES, messages_body(system=SYSTEM, messages=second), None)
    # The answer as the gateway records it: its text, then the call as the stream writes it.
    recorded = message_segment("assistant", "Let me look." + tool_use_field(call).decode())
    assert turn2.canonical.startswith(turn1.canonical + recorded)
    assert turn1.first_turn and not turn2.first_turn
    assert turn1.canonical[turn1.distinct_from :].startswith(message_segment("user", "weather?"))


def test_what_the_engine_never_sees_does_not_tell_prompts_apart() -> None:
    billing = {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc"}
    plain = parse_request(Endpoint.MESSAGES, messages_body(system=SYSTEM), None)
    marked = [billing, {"type": "text", "text": SYSTEM}]
    assert parse_request(Endpoint.MESSAGES, messages_body(system=marked), None) == plain

    def canonical(**fields: Any) -> bytes:
        return parse_request(Endpoint.MESSAGES, messages_body(**fields), None).canonical

    image = {"type": "image", "source": {"type": "url", "url": "https://x/cat.png"}}
    text = {"type": "text", "text": "hi"}
    marked_image = image | {"cache_control": {"type": "ephemeral"}}
    with_image = canonical(messages=[{"role": "user", "content": [image, text]}])
    assert with_image != plain.canonical
    assert canonical(messages=[{"role": "user", "content": [marked_image, text]}]) == with_image
    tools = [WEATHER, {**WEATHER, "name": "other", "cache_control": {"type": "ephemeral"}}]
    untagged = [WEATHER, {**WEATHER, "name": "other"}]
    assert canonical(tools=tools) == canonical(tools=untagged)


def test_the_session_is_metadata_user_id_and_bad_bodies_are_refused() -> None:
    keyed = parse_request(Endpoint.MESSAGES, messages_body(metadata={"user_id": "u1"}), None)
    assert keyed.session_key == session_hash("u1")
    header = parse_request(Endpoint.MESSAGES, messages_body(metadata={"user_id": "u1"}), "h")
    assert header.session_key == session_hash("h")
    for bad, param in [
        (messages_body(metadata="u1"), "metadata"),
        (messages_body(metadata={"user_id": 7}), "metadata.user_id"),
        (messages_body(metadata={"user_id": "u" * 600}), "metadata.user_id"),
        (messages_body(messages=[]), "messages"),
        (messages_body(system=7), "system"),
        (messages_body(messages=[{"role": "user", "content": 7}]), "messages"),
    ]:
        with pytest.raises(BadRequest) as refused:
            parse_request(Endpoint.MESSAGES, bad, None)
        assert refused.value.param == param
    counted = parse_request(Endpoint.COUNT_TOKENS, messages_body(cache_salt="s"), None)
    assert (counted.canonical, counted.cache_salt) == (b"", None)


def test_the_engine_renders_the_body_as_vllm_converts_it() -> None:
    call = {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}
    body = {
        "system": [{"type": "text", "text": "S1"}, {"type": "text", "text": "S2"}],
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [{"type": "text", "text": "a"}, call]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "42"}],
            },
            {"role": "system", "content": "late"},
        ],
        "tools": [WEATHER],
    }
    rendered = chat_messages(body, merge_inline_system=False)
    assert rendered is not None
    messages, tools = rendered
    called = {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    assert messages == [
        {"role": "system", "content": "S1S2"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "tool_calls": [called]},
        {"role": "tool", "tool_call_id": "t1", "content": "42"},
        {"role": "system", "content": "late"},
    ]
    assert tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city.",
                "parameters": WEATHER["input_schema"],
            },
        }
    ]
    merged = chat_messages(body, merge_inline_system=True)
    assert merged is not None and merged[0][0] == {"role": "system", "content": "S1S2late"}
    image = {"type": "image", "source": {"type": "url", "url": "https://x/cat.png"}}
    assert chat_messages({"messages": [{"role": "user", "content": [image]}]}, False) is None


def event(kind: str, **fields: object) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields})


def test_stream_events_give_the_answer_and_the_usage_across_chunk_boundaries() -> None:
    start = {"id": "m1", "type": "message", "usage": {"input_tokens": 90, "output_tokens": 0}}
    tool = {"type": "tool_use", "id": "t1", "name": "f", "input": {}}
    usage = {"input_tokens": 10, "output_tokens": 5, "cache_read_input_tokens": 64}
    usage["cache_creation_input_tokens"] = 16
    stream = (
        b"\n\n".join(
            [
                event("message_start", message=start),
                event("ping"),
                event("content_block_start", index=0, content_block={"type": "text", "text": ""}),
                event("content_block_delta", index=0, delta={"type": "text_delta", "text": "Hi "}),
                event(
                    "content_block_delta", index=0, delta={"type": "text_delta", "text": "there"}
                ),
                event("content_block_stop", index=0),
                event("content_block_start", index=1, content_block=tool),
                event("content_block_delta", index=1, delta={"partial_json": '{"a"'}),
                event("content_block_delta", index=1, delta={"partial_json": ": 1}"}),
                event("content_block_stop", index=1),
                event("message_delta", delta={"stop_reason": "tool_use"}, usage=usage),
                event("message_stop"),
            ]
        )
        + b"\n\n"
    )
    for size in (1, 7, len(stream)):
        observer = StreamObserver()
        relayed = b"".join(
            observer.feed(stream[at : at + size]) for at in range(0, len(stream), size)
        )
        seen = observer.seen
        assert relayed == stream
        assert (seen.prompt_tokens, seen.cached_tokens, seen.completion_tokens) == (90, 64, 5)
        call = tool_use_field({**tool, "input": {"a": 1}}).decode()
        assert seen.answer == "Hi there" + call and seen.complete
    whole = {"type": "message", "content": [{"type": "text", "text": "Hi"}], "usage": usage}
    seen = observe_body(orjson.dumps(whole))
    assert (seen.prompt_tokens, seen.cached_tokens, seen.answer) == (90, 64, "Hi")


# -- through the gateway -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def gateway() -> Iterator[GatewayProcess]:
    replicas = EmulatedReplicas(2, MODEL).start()
    try:
        with GatewayProcess(replicas.urls, "--api-key", KEY) as process:
            wait_until(
                lambda: (
                    httpx.get(process.url + "/ready", timeout=PATIENCE_SECONDS).status_code == 200
                ),
                "ready",
            )
            yield process
    finally:
        replicas.stop()


@pytest.fixture
def client(gateway: GatewayProcess) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=gateway.url, api_key=KEY, max_retries=0) as api:
        yield api


def test_plain_and_streamed_messages(client: anthropic.Anthropic) -> None:
    question: Any = [{"role": "user", "content": words(12, "pl")}]
    raw = client.messages.with_raw_response.create(
        model=MODEL,
        max_tokens=6,
        system=SYSTEM,
        messages=question,
    )
    message = raw.parse()
    assert raw.headers["x-gateway-route"] in ("hash", "prefix", "owner")
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "text" and message.content[0].text
    assert message.usage.output_tokens == 6 and message.usage.input_tokens > 0
    again: Any = [{"role": "user", "content": words(12, "st")}]
    with client.messages.stream(
        model=MODEL,
        max_tokens=5,
        system=SYSTEM,
        messages=again,
    ) as stream:
        kinds = [item.type for item in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.count("text") == 5 and "message_delta" in kinds
    assert final.usage.output_tokens == 5
    # The system prompt's blocks, cached by the first request, were read from the cache.
    assert (final.usage.cache_read_input_tokens or 0) > 0


def test_a_five_turn_conversation_stays_on_one_replica_with_its_cache_growing(
    gateway: GatewayProcess, client: anthropic.Anthropic
) -> None:
    before = gateway.metrics()
    history: list[Any] = []
    backends, cached = [], []
    for turn in range(5):
        history.append({"role": "user", "content": words(20, f"f{turn}")})
        message, backend = converse(
            client,
            turn == 2,
            model=MODEL,
            max_tokens=12,
            system=SYSTEM,
            tools=[WEATHER],
            messages=history,
        )
        backends.append(backend)
        cached.append(message.usage.cache_read_input_tokens)
        history.append({"role": "assistant", "content": message.content})
    after = gateway.metrics()
    assert len(set(backends)) == 1, backends
    assert cached == sorted(cached) and cached[-1] > cached[1] > 0, cached

    def grown(name: str) -> float:
        return metric_of(after, name) - metric_of(before, name)

    assert grown("gateway_affinity_hits_total") == 4
    assert grown("gateway_cache_breaks_total") == 0
    assert grown("gateway_upstream_cached_tokens_total") == sum(cached)


def converse(client: anthropic.Anthropic, streamed: bool, **fields: Any) -> tuple[Any, str]:
    """One message, streamed or not; the message and the replica that answered."""
    if streamed:
        with client.messages.stream(**fields) as stream:
            return stream.get_final_message(), stream.response.headers["x-gateway-backend"]
    raw = client.messages.with_raw_response.create(**fields)
    return raw.parse(), raw.headers["x-gateway-backend"]


def metric_of(text: str, name: str) -> float:
    return metric_value(text, name, model=MODEL)


def test_a_tool_call_and_its_result_continue_the_conversation(
    gateway: GatewayProcess, client: anthropic.Anthropic
) -> None:
    history: list[Any] = [{"role": "user", "content": words(10, "wx")}]
    called = client.messages.create(
        model=MODEL,
        max_tokens=4,
        system=SYSTEM,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=history,
    )
    call = called.content[0]
    assert call.type == "tool_use" and call.name == "get_weather"
    history.append({"role": "assistant", "content": called.content})
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}
    history.append({"role": "user", "content": [result]})
    before = metric_of(gateway.metrics(), "gateway_affinity_hits_total")
    answered = client.messages.create(
        model=MODEL,
        max_tokens=4,
        system=SYSTEM,
        tools=[WEATHER],
        messages=history,
    )
    assert answered.content[0].type == "text"
    after = gateway.metrics()
    assert metric_of(after, "gateway_affinity_hits_total") == before + 1
    assert metric_of(after, "gateway_cache_breaks_total") == 0


def test_keys_as_anthropic_clients_send_them_and_errors_in_their_shape(
    gateway: GatewayProcess,
) -> None:
    question: Any = [{"role": "user", "content": "hello"}]
    with anthropic.Anthropic(base_url=gateway.url, auth_token=KEY, max_retries=0) as bearer:
        assert bearer.messages.create(model=MODEL, max_tokens=2, messages=question).content
    wrong = anthropic.Anthropic(base_url=gateway.url, api_key="wrong", max_retries=0)
    with wrong, pytest.raises(anthropic.AuthenticationError) as refused:
        wrong.messages.create(model=MODEL, max_tokens=2, messages=question)
    assert refused.value.status_code == 401
    assert refused.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "Incorrect API key provided."},
    }
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    for body, status, kind in [
        (messages_body(model="no-such-model"), 404, "not_found_error"),
        (messages_body(model=MODEL, messages="hi"), 400, "invalid_request_error"),
        (b"{", 400, "invalid_request_error"),
    ]:
        answer = httpx.post(
            gateway.url + "/v1/messages", content=body, headers=headers, timeout=PATIENCE_SECONDS
        )
        assert answer.status_code == status
        assert answer.json()["type"] == "error" and answer.json()["error"]["type"] == kind
    wrong_method = httpx.get(
        gateway.url + "/v1/messages", headers=headers, timeout=PATIENCE_SECONDS
    )
    assert wrong_method.status_code == 405 and wrong_method.json()["type"] == "error"
    # The OpenAI paths keep OpenAI's shape, and take the same key in either header.
    chat = {"model": MODEL, "messages": question, "max_tokens": 2}
    openai_path = httpx.post(
        gateway.url + "/v1/chat/completions", json=chat, headers=headers, timeout=PATIENCE_SECONDS
    )
    assert openai_path.status_code == 200
    refused_chat = httpx.post(
        gateway.url + "/v1/chat/completions", json={"model": MODEL}, timeout=PATIENCE_SECONDS
    )
    assert refused_chat.status_code == 401 and "error" in refused_chat.json()


def test_explain_reads_a_messages_body(gateway: GatewayProcess) -> None:
    body = orjson.loads(messages_body(model=MODEL, system=SYSTEM))
    explained = httpx.post(
        gateway.url + "/admin/explain", json=body, timeout=PATIENCE_SECONDS
    ).json()
    assert explained["endpoint"] == "/v1/messages" and explained["prompt_blocks"] > 0
    del body["system"]
    as_anthropic = {"anthropic-version": "2023-06-01"}
    headed = httpx.post(
        gateway.url + "/admin/explain", json=body, headers=as_anthropic, timeout=PATIENCE_SECONDS
    ).json()
    assert headed["endpoint"] == "/v1/messages"
    assert httpx.post(gateway.url + "/admin/explain", json=body, timeout=PATIENCE_SECONDS).json()[
        "endpoint"
    ] == ("/v1/chat/completions")


def test_count_tokens_is_routed_by_model(client: anthropic.Anthropic) -> None:
    raw = client.messages.with_raw_response.count_tokens(
        model=MODEL, system=SYSTEM, messages=[{"role": "user", "content": "how many?"}]
    )
    assert raw.headers["x-gateway-route"] == "least_loaded"
    assert raw.parse().input_tokens > 20


PASSED_ON = (
    "--api-key",
    KEY,
    "--isolate-tenants",
    "--forward-priority",
    "--max-body-bytes",
    "8192",
)


def test_what_a_replica_is_sent_and_a_cut_stream_ending_in_an_error_event(tmp_path: Path) -> None:
    """The version headers pass through; the client's key stops at the gateway; the tenant's
    salt and priority are set as on chat (the priority as the header vLLM's Messages endpoint
    reads); count_tokens is left as sent; body limits hold; a broken stream ends in Anthropic's
    `error` event; a tenant's budget refuses in Anthropic's shape."""
    config = tmp_path / "gateway.yaml"
    config.write_text(
        yaml.safe_dump({"tenants": [{"name": "once", "api_key": "once", "requests_per_minute": 1}]})
    )
    with (
        FaultServer() as replica,
        GatewayProcess(
            [f"fault-model={replica.url}"], *PASSED_ON, "--config", str(config)
        ) as gateway,
    ):
        wait_until(
            lambda: httpx.get(gateway.url + "/ready", timeout=PATIENCE_SECONDS).status_code == 200,
            "ready",
        )
        headers = {
            "x-api-key": KEY,
            "anthropic-version": "2023-06-01",
            "anthropic-beta": "prompt-caching-2024-07-31",
        }
        body = messages_body(model="fault-model")
        answer = httpx.post(
            gateway.url + "/v1/messages", content=body, headers=headers, timeout=PATIENCE_SECONDS
        )
        assert answer.status_code == 200
        sent = replica.seen[-1]
        assert sent.path == "/v1/messages"
        assert orjson.loads(sent.body) == orjson.loads(body) | {
            "cache_salt": tenant_of(KEY.encode())
        }
        assert sent.headers["anthropic-version"] == "2023-06-01"
        assert sent.headers["anthropic-beta"] == "prompt-caching-2024-07-31"
        assert sent.headers["x-vllm-priority"] == "0"
        assert "x-api-key" not in sent.headers and "authorization" not in sent.headers
        counted = httpx.post(
            gateway.url + "/v1/messages/count_tokens",
            content=body,
            headers=headers,
            timeout=PATIENCE_SECONDS,
        )
        assert counted.status_code == 200 and replica.seen[-1].body == body
        large = messages_body(model="fault-model", system="x" * 9000)
        too_large = httpx.post(
            gateway.url + "/v1/messages", content=large, headers=headers, timeout=PATIENCE_SECONDS
        )
        assert too_large.status_code == 413
        assert too_large.json()["error"]["type"] == "request_too_large"
        budgeted = {**headers, "x-api-key": "once"}
        assert httpx.post(
            gateway.url + "/v1/messages", content=body, headers=budgeted, timeout=PATIENCE_SECONDS
        ).is_success
        spent = httpx.post(
            gateway.url + "/v1/messages", content=body, headers=budgeted, timeout=PATIENCE_SECONDS
        )
        assert spent.status_code == 429 and "retry-after" in spent.headers
        assert spent.json()["error"]["type"] == "rate_limit_error"
        replica.mode = "cut"
        streamed = messages_body(model="fault-model", stream=True)
        cut = httpx.post(
            gateway.url + "/v1/messages",
            content=streamed,
            headers=headers,
            timeout=PATIENCE_SECONDS,
        )
    last = cut.content.rstrip(b"\n").split(b"\n\n")[-1]
    assert last.startswith(b"event: error\ndata: ")
    error = orjson.loads(last.split(b"data: ", 1)[1])
    assert error == {
        "type": "error",
        "error": {"type": "api_error", "message": "the upstream response broke off"},
    }
