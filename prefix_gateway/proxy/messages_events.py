"""Reading an Anthropic Messages response, whole or as its stream's events (`message_start`,
`content_block_*`, `message_delta`, `message_stop`; `ping` and `error` carry nothing to read),
for what the gateway records: the usage, and the answer as the conversation's next request
carries it back (its text, then each tool call as the canonical stream writes a `tool_use`
block), so that the next turn is seen to extend it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import orjson

from prefix_gateway.prompt.messages_api import tool_use_field

MESSAGE_EVENTS = frozenset(
    {
        "message_start",
        "message_delta",
        "message_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "ping",
        "error",
    }
)


class Heard(Protocol):
    """What the events are told to (`prefix_gateway.proxy.usage.Observation`)."""

    complete: bool

    def add_answer(self, text: str) -> None: ...

    def take_usage(self, usage: Any) -> None: ...


def answer_parts(content: Any) -> Iterator[str]:
    """A message's content blocks as the parts of the answer that is recorded."""
    if not isinstance(content, list):
        return
    for block in content:
        if not isinstance(block, dict):
            continue
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            yield block["text"]
        elif kind == "tool_use":
            yield tool_use_field(block).decode()


class MessageEvents:
    """One stream's events in order: a tool call's input arrives in pieces of JSON, whole
    only at its block's end."""

    __slots__ = ("_call", "_input")

    def __init__(self) -> None:
        self._call: dict[str, Any] | None = None
        self._input: list[str] = []

    def take(self, kind: str, event: dict[str, Any], heard: Heard) -> None:
        if kind == "content_block_delta":
            delta = event.get("delta")
            if not isinstance(delta, dict):
                return
            if delta.get("type") == "text_delta" and isinstance(delta.get("text"), str):
                heard.add_answer(delta["text"])
            elif self._call is not None and isinstance(delta.get("partial_json"), str):
                self._input.append(delta["partial_json"])
        elif kind == "content_block_start":
            block = event.get("content_block")
            if isinstance(block, dict) and block.get("type") == "tool_use":
                self._call, self._input = block, []
        elif kind == "content_block_stop":
            if self._call is not None:
                heard.add_answer(self._called(self._call))
                self._call = None
        elif kind == "message_delta":
            heard.take_usage(event.get("usage"))
        elif kind == "message_start":
            message = event.get("message")
            if isinstance(message, dict):
                heard.take_usage(message.get("usage"))
        elif kind == "message_stop":
            heard.complete = True

    def _called(self, call: dict[str, Any]) -> str:
        given = "".join(self._input)
        try:
            arguments = orjson.loads(given) if given else call.get("input", {})
        except orjson.JSONDecodeError:
            arguments = given  # cut short: recorded as it came, which no next turn repeats
        return tool_use_field({**call, "input": arguments}).decode()
