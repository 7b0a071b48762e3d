"""`--observe-usage`: a stream's usage asked for upstream on the client's behalf, and taken out
of the stream again on its way back.

First the pieces (the body rewrite, the SSE stripping across every chunk boundary), then the
gateway on a real port in front of emulated replicas, with the official `openai` client, and
in front of a replica that ignores the option.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam

from prefix_gateway.emulator.replicas import EmulatedReplicas
from prefix_gateway.proxy.rewrite import request_usage, with_cache_salt
from prefix_gateway.proxy.usage import StreamObserver
from tests.conftest import MODEL
from tests.fault_servers import FaultServer
from tests.support import PATIENCE_SECONDS, GatewayProcess, wait_until
from tests.words import words

# -- the request body ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "options"),
    [
        (b'{"model":"m","stream":true}', {"include_usage": True}),
        (b' {"model": "m", "stream": true}\n', {"include_usage": True}),
        (b'{"model":"m","stream_options":null}', {"include_usage": True}),
        (
            b'{"model":"m","stream_options":{"include_usage":false,"continuous_usage_stats":false}}',
            {"include_usage": True, "continuous_usage_stats": False},
        ),
        (b"{}", {"include_usage": True}),
        # The key's text inside a value: still one `stream_options`, the right one.
        (
            b'{"model":"m","messages":[{"role":"user","content":"\\"stream_options\\""}]}',
            {"include_usage": True},
        ),
    ],
)
def test_the_body_asks_for_usage_and_keeps_everything_else(
    body: bytes, options: dict[str, bool]
) -> None:
    original = orjson.loads(body)
    rewritten = orjson.loads(request_usage(body))
    assert rewritten.pop("stream_options") == options
    original.pop("stream_options", None)
    assert rewritten == original


def test_a_body_without_the_option_is_spliced_not_reserialised() -> None:
    body = b'{"model":"m","temperature":1.0,"x":"\\u00e9"}'
    assert request_usage(body) == body[:-1] + b',"stream_options":{"include_usage":true}}'


@pytest.mark.parametrize(
    "body",
    [
        b'{"model":"m","prompt":"p"}',
        b"{}",
        b'{"model":"m","cache_salt":"mine","prompt":"p"}',  # a client's own salt is replaced
        b'{"model":"m","prompt":"\\"cache_salt\\""}',
    ],
)
def test_every_request_of_a_tenant_carries_its_salt(body: bytes) -> None:
    original = orjson.loads(body)
    salted = orjson.loads(with_cache_salt(body, "tenant-a"))
    assert salted.pop("cache_salt") == "tenant-a"
    original.pop("cache_salt", None)
    assert salted == original


# -- the stream ------------------------------------------------------------------------------


def chunk(text: str) -> bytes:
    message = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    return b"data: " + orjson.dumps(message)


USAGE = {
    "prompt_tokens": 120,
    "completion_tokens": 2,
    "prompt_tokens_details": {"cached_tokens": 96},
}
USAGE_EVENT = b"data: " + orjson.dumps({"id": "x", "choices": [], "usage": USAGE})


def stream(separator: bytes, with_usage: bool = True) -> tuple[bytes, bytes]:
    """A stream as a replica sends it, and as the client should get it when usage is stripped."""
    kept = [b": keep-alive", chunk("Hel"), chunk("lo \u00e9"), b"data: [DONE]"]
    sent = [*kept[:3], USAGE_EVENT, kept[3]] if with_usage else kept
    return (
        b"".join(event + separator for event in sent),
        b"".join(event + separator for event in kept),
    )


@pytest.mark.parametrize("separator", [b"\n\n", b"\r\n\r\n"])
def test_the_usage_event_is_stripped_at_every_chunk_boundary(separator: bytes) -> None:
    sent, expected = stream(separator)
    for cut in range(1, len(sent)):
        for second_cut in (cut, min(len(sent), cut + 7)):
            pieces = [sent[:cut], sent[cut:second_cut], sent[second_cut:]]
            observer = StreamObserver(strip_usage=True)
            out = b"".join(observer.feed(piece) for piece in pieces if piece) + observer.finish()
            assert out == expected, (cut, second_cut)
            assert observer.seen.cached_tokens == 96 and observer.seen.prompt_tokens == 120
            assert observer.seen.answer == "Hello \u00e9"


def test_complete_events_leave_at_once_and_a_cut_one_waits_for_its_end() -> None:
    observer = StreamObserver(strip_usage=True)
    first, second = chunk("a") + b"\n\n", chunk("b") + b"\n\n"
    assert observer.feed(first + second[:10]) == first
    assert observer.feed(second[10:] + USAGE_EVENT[:20]) == second
    assert observer.feed(USAGE_EVENT[20:] + b"\n\n") == b""
    assert observer.seen.cached_tokens == 96


def test_without_stripping_chunks_pass_as_they_came() -> None:
    sent, _ = stream(b"\r\n\r\n")
    observer = StreamObserver()
    pieces = [sent[:17], sent[17:100], sent[100:]]
    assert [observer.feed(piece) for piece in pieces] == pieces
    assert observer.finish() == b"" and observer.rest() == b""
    assert observer.seen.cached_tokens == 96 and observer.seen.answer == "Hello \u00e9"


def test_a_last_event_without_its_blank_line_is_still_read() -> None:
    observer = StreamObserver(strip_usage=True)
    assert observer.feed(chunk("a") + b"\n\n" + USAGE_EVENT) == chunk("a") + b"\n\n"
    assert observer.finish() == b""  # the usage event, unterminated, is still taken out
    assert observer.seen.cached_tokens == 96
    observer = StreamObserver(strip_usage=True)
    observer.feed(b"data: [DONE]")
    assert observer.finish() == b"data: [DONE]"


def test_a_stream_broken_mid_event_hands_back_what_was_held() -> None:
    observer = StreamObserver(strip_usage=True)
    assert observer.feed(chunk("a") + b"\n\n" + chunk("b")[:9]) == chunk("a") + b"\n\n"
    assert observer.rest() == chunk("b")[:9]
    assert observer.rest() == b""
    assert observer.seen.answer == "a"


def test_only_a_usage_only_event_is_stripped() -> None:
    with_content = orjson.dumps(
        {"choices": [{"index": 0, "delta": {"content": "x"}}], "usage": USAGE}
    )
    no_choices_key = orjson.dumps({"id": "x", "usage": USAGE})
    null_usage = orjson.dumps({"choices": [], "usage": None})
    events = [b"data: " + with_content, b"data: " + no_choices_key, b"data: " + null_usage]
    observer = StreamObserver(strip_usage=True)
    out = observer.feed(b"".join(event + b"\n\n" for event in events))
    assert out == events[0] + b"\n\n" + events[2] + b"\n\n"


def test_something_that_is_not_sse_is_not_held_back_for_ever() -> None:
    observer = StreamObserver(strip_usage=True)
    blob = b"x" * (1 << 20)
    assert observer.feed(blob) == b""
    assert observer.feed(b"yz") == blob + b"yz"
    assert observer.feed(b"more") == b"more" and observer.finish() == b""


# -- through the gateway ---------------------------------------------------------------------


def ready(gateway: GatewayProcess) -> GatewayProcess:
    """Wait until a backend is admitted: a probe slowed by a busy machine may fail the first."""
    wait_until(
        lambda: (
            httpx.get(gateway.url + "/ready?require_backend=true", timeout=5).status_code == 200
        ),
        "a backend admitted",
    )
    return gateway


@pytest.fixture(scope="module")
def replicas() -> Iterator[EmulatedReplicas]:
    with EmulatedReplicas(2, MODEL, ["--chat-template", "plain"]) as started:
        yield started


@pytest.fixture(scope="module")
def observing(replicas: EmulatedReplicas) -> Iterator[GatewayProcess]:
    with GatewayProcess(replicas.urls, "--observe-usage") as started:
        yield ready(started)


@pytest.fixture(scope="module")
def plain(replicas: EmulatedReplicas) -> Iterator[GatewayProcess]:
    with GatewayProcess(replicas.urls) as started:
        yield ready(started)


def streamed(
    gateway: GatewayProcess, tag: str, include_usage: bool = False
) -> tuple[list[ChatCompletionChunk], str]:
    """The chunks of a streamed chat completion through `gateway`, and its answer."""
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    system: ChatCompletionMessageParam = {"role": "system", "content": words(300, tag)}
    question: ChatCompletionMessageParam = {"role": "user", "content": words(20, tag + "q")}
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[system, question],
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True} if include_usage else openai.omit,
        )
    )
    answer = "".join(item.choices[0].delta.content or "" for item in chunks if item.choices)
    return chunks, answer


def counted(gateway: GatewayProcess, name: str, before: float) -> float:
    """How much `name` grew since `before`; it grows just after the response ended."""
    wait_until(lambda: gateway.metric(name, model=MODEL) != before, f"{name} to grow")
    return gateway.metric(name, model=MODEL) - before


def test_a_stream_without_include_usage_gets_none_but_feeds_the_metrics(
    observing: GatewayProcess,
) -> None:
    streamed(observing, "ou1")  # caches the system prompt on a replica
    cached = observing.metric("gateway_upstream_cached_tokens_total", model=MODEL)
    prompts = observing.metric("gateway_upstream_prompt_tokens_total", model=MODEL)
    chunks, answer = streamed(observing, "ou1")
    assert answer and all(item.usage is None for item in chunks)
    assert all(item.choices for item in chunks)
    # 19 of the prompt's 20 blocks: the engine computes at least its last token.
    assert counted(observing, "gateway_upstream_cached_tokens_total", cached) == 304
    assert counted(observing, "gateway_upstream_prompt_tokens_total", prompts) == 320


def test_a_stream_with_include_usage_gets_it_once(observing: GatewayProcess) -> None:
    chunks, answer = streamed(observing, "ou2", include_usage=True)
    with_usage = [item for item in chunks if item.usage is not None]
    assert answer and len(with_usage) == 1
    assert with_usage[0].choices == [] and with_usage[0] is chunks[-1]
    usage = with_usage[0].usage
    assert usage is not None and usage.prompt_tokens == 320


def test_without_the_flag_nothing_is_asked_for(plain: GatewayProcess) -> None:
    prompts = plain.metric("gateway_upstream_prompt_tokens_total", model=MODEL)
    answered = plain.metric("gateway_requests_total", model=MODEL)
    chunks, answer = streamed(plain, "ou3")
    assert answer and all(item.usage is None for item in chunks)
    # The request is counted where its usage would be, just before: once it is, the replica's
    # usage would have been too. It was not asked for, so it sent none: nothing to count.
    wait_until(
        lambda: plain.metric("gateway_requests_total", model=MODEL) > answered,
        "the stream counted as answered",
    )
    assert plain.metric("gateway_upstream_prompt_tokens_total", model=MODEL) == prompts


RAW_BODY = orjson.dumps(
    {"model": "fault-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
)


@pytest.mark.parametrize("observe", [False, True])
def test_an_upstream_that_ignores_the_option_streams_through_unchanged(observe: bool) -> None:
    with FaultServer() as replica:
        args = ("--observe-usage",) if observe else ()
        with GatewayProcess([f"fault-model={replica.url}"], *args) as gateway:
            ready(gateway)
            direct = httpx.post(
                replica.url + "/v1/chat/completions", content=RAW_BODY, timeout=PATIENCE_SECONDS
            ).content
            routed = httpx.post(
                gateway.url + "/v1/chat/completions",
                content=RAW_BODY,
                headers={"content-type": "application/json"},
                timeout=10,
            )
        assert routed.status_code == 200, routed.text
        assert routed.content == direct
        sent = orjson.loads(replica.seen[-1].body)
        if observe:
            assert sent.pop("stream_options") == {"include_usage": True}
            assert sent == orjson.loads(RAW_BODY)
        else:
            assert replica.seen[-1].body == RAW_BODY  # byte for byte


def test_a_stream_cut_upstream_still_ends_in_an_error_event() -> None:
    with (
        FaultServer(mode="cut", cut_after=2) as replica,
        GatewayProcess([f"fault-model={replica.url}"], "--observe-usage") as gateway,
    ):
        ready(gateway)
        routed = httpx.post(gateway.url + "/v1/chat/completions", content=RAW_BODY, timeout=10)
    events = routed.content.split(b"\n\n")
    assert events[-1] == b""
    assert [event.startswith(b"data: {") for event in events[:-1]] == [True, True, True]
    assert b'"stream_broken"' in events[2]


def response_event(kind: str, **fields: object) -> bytes:
    payload = orjson.dumps({"type": kind, **fields})
    return b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n"


def test_responses_events_give_the_id_the_answer_and_the_usage() -> None:
    usage = {"input_tokens": 40, "input_tokens_details": {"cached_tokens": 32}, "output_tokens": 2}
    events = b"".join(
        [
            response_event("response.created", response={"id": "resp_7", "usage": None}),
            response_event("response.output_text.delta", output_index=0, delta="he"),
            response_event("response.output_text.delta", output_index=0, delta="llo"),
            response_event("response.completed", response={"id": "resp_7", "usage": usage}),
        ]
    )
    for size in (1, 7, len(events)):
        observer = StreamObserver()
        seen = observer.seen
        for start in range(0, len(events), size):
            assert observer.feed(events[start : start + size]) == events[start : start + size]
            if seen.response_id is None:
                assert not seen.complete and seen.cached_tokens is None
        assert (seen.response_id, seen.answer) == ("resp_7", "hello")
        assert (seen.prompt_tokens, seen.cached_tokens, seen.complete) == (40, 32, True)
