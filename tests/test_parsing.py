from __future__ import annotations

import orjson
import pytest

from prefix_gateway.errors import BadRequest
from prefix_gateway.prompt.canonical import message_segment
from prefix_gateway.prompt.parsing import BodyLimits, Endpoint, parse_request, session_hash


def chat(**fields: object) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]} | fields)


def test_chat_history_only_appends() -> None:
    turn1 = [{"role": "system", "content": "S"}, {"role": "user", "content": "q1"}]
    turn2 = [*turn1, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
    first = parse_request(Endpoint.CHAT, chat(messages=turn1), None)
    second = parse_request(Endpoint.CHAT, chat(messages=turn2), None)
    assert second.canonical.startswith(first.canonical + message_segment("assistant", "a1"))


def test_roles_and_tools_change_the_stream() -> None:
    user = parse_request(Endpoint.CHAT, chat(messages=[{"role": "user", "content": "x"}]), None)
    system = parse_request(Endpoint.CHAT, chat(messages=[{"role": "system", "content": "x"}]), None)
    tools = parse_request(Endpoint.CHAT, chat(tools=[{"type": "function"}]), None)
    assert len({user.canonical, system.canonical, tools.canonical}) == 3


def test_content_parts_match_plain_text() -> None:
    parts = [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]
    as_parts = parse_request(
        Endpoint.CHAT, chat(messages=[{"role": "user", "content": parts}]), None
    )
    as_text = parse_request(
        Endpoint.CHAT, chat(messages=[{"role": "user", "content": "hello world"}]), None
    )
    assert as_parts.canonical == as_text.canonical


def test_distinct_part_starts_at_the_first_user_message() -> None:
    messages = [{"role": "system", "content": "S" * 100}, {"role": "user", "content": "q"}]
    parsed = parse_request(Endpoint.CHAT, chat(messages=messages), None)
    assert parsed.canonical[parsed.distinct_from :].startswith(message_segment("user", "q"))


def test_a_first_turn_carries_no_answer_after_its_first_user_message() -> None:
    system = {"role": "system", "content": "S"}
    question = {"role": "user", "content": "q1"}
    answer = {"role": "assistant", "content": "a1"}
    follow_up = {"role": "user", "content": "q2"}

    def first_turn(endpoint: Endpoint, body: dict[str, object]) -> bool:
        return parse_request(endpoint, orjson.dumps({"model": "m"} | body), None).first_turn

    assert first_turn(Endpoint.CHAT, {"messages": [system, question]})
    assert first_turn(Endpoint.CHAT, {"messages": [system, question, follow_up]})
    assert not first_turn(Endpoint.CHAT, {"messages": [system, question, answer, follow_up]})
    # An assistant greeting before the first question is part of the shared prompt.
    assert first_turn(Endpoint.CHAT, {"messages": [system, answer, question]})
    assert first_turn(Endpoint.RESPONSES, {"instructions": "S", "input": "q1"})
    called = {"type": "function_call_output", "call_id": "c1", "output": "42"}
    assert not first_turn(Endpoint.RESPONSES, {"input": [question, called]})
    # A plain prompt does not say where its history is.
    assert not first_turn(Endpoint.COMPLETIONS, {"prompt": "S q1"})


def test_session_key_sources_are_kept_as_hashes() -> None:
    assert parse_request(Endpoint.CHAT, chat(), "h1").session_key == session_hash("h1")
    keyed = parse_request(Endpoint.CHAT, chat(prompt_cache_key="k1"), None)
    assert keyed.session_key == session_hash("k1") != session_hash("h1")
    assert parse_request(Endpoint.CHAT, chat(user="u1"), None).session_key is None
    from_user = parse_request(Endpoint.CHAT, chat(user="u1"), None, session_from_user=True)
    assert from_user.session_key == session_hash("u1")
    assert len(session_hash("x" * 512)) == 16


def test_limits_refuse_before_parsing() -> None:
    limits = BodyLimits(depth=8, values=100, messages=3, prompts=4, session_key_bytes=10)
    many = [{"role": "user", "content": "q"}] * 4
    deep = {"model": "m", "prompt": "x", "extra": [[[[[[[[[1]]]]]]]]]}
    cases = [
        (Endpoint.CHAT, chat(messages=many), "too_many_messages"),
        (Endpoint.CHAT, chat(prompt_cache_key="k" * 11), "session_key_too_long"),
        (
            Endpoint.COMPLETIONS,
            orjson.dumps({"model": "m", "prompt": [[1]] * 60}),
            "too_many_values",
        ),
        (Endpoint.COMPLETIONS, orjson.dumps(deep), "too_deep"),
    ]
    for endpoint, body, code in cases:
        with pytest.raises(BadRequest) as refused:
            parse_request(endpoint, body, None, limits=limits)
        assert refused.value.code == code


def test_completion_prompts() -> None:
    text = parse_request(Endpoint.COMPLETIONS, orjson.dumps({"model": "m", "prompt": "abc"}), None)
    assert text.canonical == b"abc"
    ids = orjson.dumps({"model": "m", "prompt": [1, 2, 3]})
    assert parse_request(Endpoint.COMPLETIONS, ids, None).canonical != b""


def test_default_model_and_stream_flags() -> None:
    body = orjson.dumps(
        {
            "messages": [{"role": "user", "content": "x"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    parsed = parse_request(Endpoint.CHAT, body, None, default_model="fallback")
    assert (parsed.model, parsed.stream, parsed.wants_usage) == ("fallback", True, True)


BAD = [
    (b"{not json", "invalid_json"),
    (b"[1, 2]", "invalid_type"),
    (orjson.dumps({"messages": [{"role": "user", "content": "x"}]}), "missing_model"),
    (orjson.dumps({"model": 5, "messages": []}), "invalid_type"),
    (orjson.dumps({"model": "m", "messages": []}), "invalid_messages"),
    (orjson.dumps({"model": "m", "messages": "hi"}), "invalid_messages"),
    (orjson.dumps({"model": "m", "messages": [{"role": "user", "content": 5}]}), "invalid_type"),
    (orjson.dumps({"model": "m", "messages": [{"role": "user", "content": [5]}]}), "invalid_type"),
    (chat(stream="yes"), "invalid_type"),
]


@pytest.mark.parametrize(("body", "code"), BAD)
def test_bad_input_is_a_clear_400(body: bytes, code: str) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_request(Endpoint.CHAT, body, None)
    assert caught.value.code == code
    error = orjson.loads(caught.value.body())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"


def responses(**fields: object) -> bytes:
    return orjson.dumps({"model": "m", "input": "hi"} | fields)


def test_responses_input_reads_as_chat_messages() -> None:
    as_string = parse_request(Endpoint.RESPONSES, responses(instructions="S", input="q"), None)
    as_items = parse_request(
        Endpoint.RESPONSES,
        responses(
            instructions="S",
            input=[
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "q"}],
                }
            ],
        ),
        None,
    )
    as_chat = parse_request(
        Endpoint.CHAT,
        chat(messages=[{"role": "system", "content": "S"}, {"role": "user", "content": "q"}]),
        None,
    )
    assert as_string.canonical == as_items.canonical == as_chat.canonical
    assert as_string.canonical[as_string.distinct_from :] == message_segment("user", "q")


def test_a_responses_conversation_resent_whole_extends_the_previous_prompt_and_answer() -> None:
    turn1: list[dict[str, object]] = [{"role": "user", "content": "q1"}]
    answer = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": "a1", "annotations": []}],
    }
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "id": "fc"}
    output = {"type": "function_call_output", "call_id": "c1", "output": "sunny"}
    turn2 = [*turn1, answer, call, output, {"role": "user", "content": "q2"}]
    first = parse_request(Endpoint.RESPONSES, responses(input=turn1, tools=[{"type": "x"}]), None)
    second = parse_request(Endpoint.RESPONSES, responses(input=turn2, tools=[{"type": "x"}]), None)
    assert second.canonical.startswith(first.canonical + message_segment("assistant", "a1"))
    # An item's id and status are not part of the prompt.
    renamed = [*turn1, {**answer, "id": "msg_2", "status": "incomplete"}, call, output]
    third = parse_request(Endpoint.RESPONSES, responses(input=renamed, tools=[{"type": "x"}]), None)
    assert second.canonical.startswith(third.canonical)


def test_responses_bodies_are_checked() -> None:
    previous = parse_request(Endpoint.RESPONSES, responses(previous_response_id="resp_1"), None)
    assert previous.previous_response_id == "resp_1"
    for bad in (
        responses(input=7),
        responses(input=[{"type": "message", "content": "no role"}]),
        responses(instructions=["x"]),
        responses(previous_response_id="r" * 129),
        responses(previous_response_id="resp 1"),
        responses(input=[{}] * 5),
    ):
        with pytest.raises(BadRequest):
            parse_request(Endpoint.RESPONSES, bad, None, limits=BodyLimits(messages=4))


def test_model_only_endpoints_carry_no_prompt() -> None:
    body = orjson.dumps({"model": "m", "prompt": "a long prompt", "previous_response_id": "x"})
    for endpoint in (Endpoint.TOKENIZE, Endpoint.RERANK_V1, Endpoint.SCORE_V1):
        parsed = parse_request(endpoint, body, None)
        assert (parsed.canonical, parsed.previous_response_id) == (b"", None)
        assert not endpoint.by_prefix and not endpoint.generates
    assert Endpoint.RESPONSES.by_prefix and Endpoint.RESPONSES.generates
