"""A Responses request as the chat messages an engine renders it as (vLLM's rules), which the
gateway tokenizes with `--tokenizer`."""

from __future__ import annotations

from typing import Any

from prefix_gateway.prompt.responses_api import chat_messages


def test_instructions_and_a_string_input_are_a_system_and_a_user_message() -> None:
    rendered = chat_messages({"instructions": "Be brief.", "input": "hello"})
    assert rendered == (
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}],
        None,
    )


def test_items_become_messages_and_a_call_joins_the_assistant_message_before_it() -> None:
    items: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"text": "b"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "c"}]},
        {"type": "function_call", "call_id": "1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "1", "output": "42"},
    ]
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}
    rendered = chat_messages({"input": items, "tools": [tool]})
    assert rendered is not None
    messages, tools = rendered
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert messages == [
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "c", "tool_calls": [call]},
        {"role": "tool", "content": "42", "tool_call_id": "1"},
    ]
    assert tools == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]


def test_what_the_engine_renders_otherwise_is_not_guessed() -> None:
    image = {"role": "user", "content": [{"type": "input_image", "image_url": "data:"}]}
    assert chat_messages({"input": [image]}) is None
    assert chat_messages({"input": [{"type": "reasoning", "summary": []}]}) is None
    assert chat_messages({"input": "hi", "tools": [{"type": "web_search"}]}) is None
