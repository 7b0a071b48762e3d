"""The emulated replica as a client sees it: a real process, the official `openai` client."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any, Protocol

import httpx
import openai
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefix_gateway.emulator.process import EmulatorProcess
from tests.support import PATIENCE_SECONDS

MODEL = "emulated-model"


@pytest.fixture(scope="module")
def replica() -> Iterator[EmulatorProcess]:
    with EmulatorProcess("--cache-blocks", "256", name=MODEL) as process:
        yield process


@pytest.fixture(scope="module")
def client(replica: EmulatorProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=replica.url + "/v1", api_key="unused") as api:
        yield api


def words(count: int, tag: str) -> str:
    return " ".join(f"{tag}{index}" for index in range(count))


def sse_events(response: httpx.Response) -> list[str]:
    assert response.headers["content-type"].startswith("text/event-stream")
    frames = response.text.split("\n\n")
    assert frames[-1] == ""
    assert all(frame.startswith("data: ") for frame in frames[:-1])
    return [frame[len("data: ") :] for frame in frames[:-1]]


def test_chat_completion_counts_tokens_exactly(client: openai.OpenAI) -> None:
    messages: Any = [
        {"role": "system", "content": words(30, "s")},
        {"role": "user", "content": words(12, "u")},
    ]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=7)
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and reply.model == MODEL
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert choice.message.content is not None and len(choice.message.content.split()) == 7
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (42, 7)
    assert reply.usage.total_tokens == 49
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    again = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=7)
    assert again.choices[0].message.content == choice.message.content
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == 32


def test_default_max_tokens_applies(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}]
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 64


def test_streamed_chat_sends_each_token_then_usage_then_done(
    replica: EmulatorProcess, client: openai.OpenAI
) -> None:
    messages: Any = [{"role": "user", "content": words(40, "t")}]
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len(chunks) == 6
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(chunk.choices[0].delta.role is None for chunk in chunks[1:5])
    assert [chunk.choices[0].finish_reason for chunk in chunks[:5]] == [None] * 4 + ["length"]
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks[:5])
    usage = chunks[5].usage
    assert chunks[5].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (40, 5, 45)
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)
    assert whole.choices[0].message.content == text

    raw = httpx.post(
        replica.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 3, "stream": True},
        timeout=PATIENCE_SECONDS,
    )
    events = sse_events(raw)
    assert events[-1] == "[DONE]" and len(events) == 4
    assert all(orjson.loads(event)["object"] == "chat.completion.chunk" for event in events[:-1])


def test_completions_take_text_batches_and_token_ids(
    replica: EmulatorProcess, client: openai.OpenAI
) -> None:
    single = client.completions.create(model=MODEL, prompt=words(20, "c"), max_tokens=4)
    assert single.object == "text_completion"
    assert single.usage is not None and single.usage.prompt_tokens == 20
    assert len(single.choices[0].text.split()) == 4

    batch = client.completions.create(model=MODEL, prompt=["a b c", "d e"], max_tokens=3)
    assert [choice.index for choice in batch.choices] == [0, 1]
    assert batch.usage is not None
    assert (batch.usage.prompt_tokens, batch.usage.completion_tokens) == (5, 6)

    ids = client.completions.create(model=MODEL, prompt=list(range(33)), max_tokens=2)
    assert ids.usage is not None and ids.usage.prompt_tokens == 33

    events = sse_events(
        httpx.post(
            replica.url + "/v1/completions",
            json={
                "model": MODEL,
                "prompt": "x y z",
                "max_tokens": 4,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            timeout=PATIENCE_SECONDS,
        )
    )
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(event) for event in events[:-1]]
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks[:4]] == [None] * 3 + ["length"]
    assert chunks[4]["choices"] == []
    assert chunks[4]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_embeddings_are_deterministic_unit_vectors(
    replica: EmulatorProcess, client: openai.OpenAI
) -> None:
    result = client.embeddings.create(model=MODEL, input=["one two", "three"])
    vectors = [item.embedding for item in result.data]
    assert [len(vector) for vector in vectors] == [32, 32]
    assert all(math.isclose(sum(x * x for x in vector), 1.0, rel_tol=1e-5) for vector in vectors)
    assert vectors[0] != vectors[1]
    assert result.usage.prompt_tokens == 3
    as_floats = httpx.post(
        replica.url + "/v1/embeddings",
        json={"model": MODEL, "input": "one two", "encoding_format": "float"},
        timeout=PATIENCE_SECONDS,
    ).json()
    assert as_floats["data"][0]["embedding"] == pytest.approx(vectors[0], rel=1e-6)


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [model.id for model in models] == [MODEL]
    assert models[0].owned_by == "vllm"
    assert models[0].model_extra == {"root": MODEL, "parent": None, "max_model_len": 4096}


def test_health_and_metrics(replica: EmulatorProcess) -> None:
    assert httpx.get(replica.url + "/health", timeout=PATIENCE_SECONDS).status_code == 200
    text = httpx.get(replica.url + "/metrics", timeout=PATIENCE_SECONDS).text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        'vllm:request_success_total{engine="0",finished_reason="abort"',
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
    ):
        assert name in text
    assert 'model_name="emulated-model"' in text


class Answered(Protocol):
    """A response of httpx, or of the one the official client is built on."""

    @property
    def status_code(self) -> int: ...

    @property
    def text(self) -> str: ...

    def json(self) -> Any: ...


def error_of(response: Answered, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    return error


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (b'{"messages": "hi"}', "messages"),
        (b'{"messages": []}', "messages"),
        (b'{"messages": [{"role": "user", "content": 3}]}', "messages"),
        (b'{"messages": [{"role": "user", "content": ""}]}', "messages"),
        # vLLM reads "9" and 9.0 as 9 (pydantic's lax mode), but not these.
        (b'{"messages": [{"role": "user", "content": "a"}], "max_tokens": "nine"}', "max_tokens"),
        (b'{"messages": [{"role": "user", "content": "a"}], "max_tokens": 9.5}', "max_tokens"),
        (b'{"messages": [{"role": "user", "content": "a"}], "max_tokens": 0}', "max_tokens"),
        (b'{"messages": [{"role": "user", "content": "a"}], "max_tokens": 5000}', "max_tokens"),
        (b'{"messages": [{"role": "user", "content": "a"}], "stream": "yes"}', "stream"),
        (b'{"messages": [{"role": "user", "content": "a"}], "n": 2}', "n"),
        (b'{"messages": [{"role": "user", "content": "a"}], "model": 7}', "model"),
    ],
)
def test_bad_chat_requests_are_400(replica: EmulatorProcess, body: bytes, param: str) -> None:
    response = httpx.post(
        replica.url + "/v1/chat/completions", content=body, timeout=PATIENCE_SECONDS
    )
    error = error_of(response, 400)
    assert error["type"] == "BadRequestError" and error["param"] == param


def test_bad_completion_and_embedding_requests_are_400(replica: EmulatorProcess) -> None:
    for path, body in (
        ("/v1/completions", {"prompt": []}),
        ("/v1/completions", {"prompt": [1, "a"]}),
        ("/v1/embeddings", {"input": None}),
        ("/v1/embeddings", {"input": "a", "encoding_format": "hex"}),
    ):
        error_of(httpx.post(replica.url + path, json=body, timeout=PATIENCE_SECONDS), 400)


def test_unknown_model_route_and_method(client: openai.OpenAI, replica: EmulatorProcess) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(
            model="other-model", messages=[{"role": "user", "content": "hi"}]
        )
    assert raised.value.status_code == 404
    error = error_of(raised.value.response, 404)
    assert error["type"] == "NotFoundError" and "other-model" in error["message"]
    error_of(httpx.get(replica.url + "/v1/nowhere", timeout=PATIENCE_SECONDS), 404)
    error_of(httpx.get(replica.url + "/v1/chat/completions", timeout=PATIENCE_SECONDS), 405)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=8,
)
request_bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from([MODEL, "other"]) | json_values,
        "messages": st.lists(
            st.fixed_dictionaries(
                {},
                optional={
                    "role": st.sampled_from(["user", "system"]) | json_values,
                    "content": st.text(max_size=20) | json_values,
                },
            )
            | json_values,
            max_size=3,
        )
        | json_values,
        "prompt": st.text(max_size=20) | json_values,
        "input": st.text(max_size=20) | json_values,
        "max_tokens": st.integers(-2, 5) | json_values,
        "stream": st.booleans() | json_values,
        "stream_options": json_values,
        "tools": json_values,
        "n": json_values,
    },
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]),
    body=request_bodies,
)
def test_no_input_makes_a_server_error(
    replica: EmulatorProcess, path: str, body: dict[str, Any]
) -> None:
    response = httpx.post(replica.url + path, content=json.dumps(body), timeout=10)
    assert response.status_code in (200, 400, 404), response.text
    if response.status_code != 200:
        error_of(response, response.status_code)


def test_chatml_template_adds_turn_tokens() -> None:
    with (
        EmulatorProcess("--chat-template", "chatml", name=MODEL) as process,
        openai.OpenAI(base_url=process.url + "/v1", api_key="unused") as api,
    ):
        reply = api.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "system", "content": words(10, "s")},
                {"role": "user", "content": words(5, "u")},
            ],
            max_tokens=1,
        )
        # Per message: start, role, newline, end; then start, "assist" + "ant", newline.
        assert reply.usage is not None and reply.usage.prompt_tokens == 15 + 2 * 4 + 4


def test_render_endpoints_answer_403_unless_scale_out_is_on(replica: EmulatorProcess) -> None:
    """As `vllm serve` without `--enable-scale-out`: routers that ask learn the flag's name."""
    messages = [{"role": "user", "content": words(5, "r")}]
    for path, body in (
        ("/v1/chat/completions/render", {"model": MODEL, "messages": messages}),
        ("/v1/completions/render", {"model": MODEL, "prompt": "a b"}),
    ):
        error = error_of(httpx.post(replica.url + path, json=body, timeout=PATIENCE_SECONDS), 403)
        assert error["type"] == "PermissionDeniedError"
        assert "--enable-scale-out" in error["message"]


def test_render_gives_the_token_ids_the_request_would_run() -> None:
    messages = [
        {"role": "system", "content": words(20, "s")},
        {"role": "user", "content": words(6, "u")},
    ]
    with EmulatorProcess("--enable-scale-out", name=MODEL) as replica:
        tokenized = httpx.post(
            replica.url + "/tokenize",
            json={"model": MODEL, "messages": messages},
            timeout=PATIENCE_SECONDS,
        ).json()["tokens"]
        chat = {"model": MODEL, "messages": messages, "max_tokens": 5, "stream": True}
        rendered = httpx.post(
            replica.url + "/v1/chat/completions/render", json=chat, timeout=PATIENCE_SECONDS
        )
        assert rendered.status_code == 200, rendered.text
        request = rendered.json()
        assert request["token_ids"] == tokenized and len(tokenized) == 26
        assert request["request_id"].startswith("chatcmpl-")
        assert (request["model"], request["stream"]) == (MODEL, True)
        assert request["sampling_params"]["max_tokens"] == 5
        # Rendering runs nothing: the same prompt is not cached afterwards.
        reply = httpx.post(
            replica.url + "/v1/chat/completions",
            json={**chat, "stream": False},
            timeout=PATIENCE_SECONDS,
        )
        assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        prompts = {"model": MODEL, "prompt": ["a b c", "d"]}
        batch = httpx.post(
            replica.url + "/v1/completions/render", json=prompts, timeout=PATIENCE_SECONDS
        ).json()
        assert [len(item["token_ids"]) for item in batch] == [3, 1]
        assert [item["request_id"][-2:] for item in batch] == ["-0", "-1"]
        error_of(
            httpx.post(
                replica.url + "/v1/chat/completions/render",
                json={"model": "other", "messages": messages},
                timeout=PATIENCE_SECONDS,
            ),
            404,
        )
