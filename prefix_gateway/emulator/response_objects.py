"""Response objects and typed stream events of the Responses API, in the shapes vLLM sends:
each event is `event: <type>` and its JSON with a `sequence_number`; a stream ends with
`response.completed` (also when the output stopped at `max_output_tokens`) and no `[DONE]`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from prefix_gateway.emulator.bodies import Usage


@dataclass(frozen=True)
class ResponseHead:
    """What a response repeats from its request, and its id."""

    id: str
    created_at: int
    model: str
    instructions: str | None
    tools: list[Any]
    tool_choice: Any
    max_output_tokens: int | None
    previous_response_id: str | None
    store: bool

    def body(
        self, status: str, output: list[dict[str, Any]], usage: Usage | None
    ) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "model": self.model,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": None,
            "output": output,
            "parallel_tool_calls": True,
            "previous_response_id": self.previous_response_id,
            "reasoning": None,
            "store": self.store,
            "temperature": 1.0,
            "text": {"format": {"type": "text"}},
            "tool_choice": self.tool_choice,
            "tools": self.tools,
            "top_p": 1.0,
            "truncation": "disabled",
            "background": False,
            "service_tier": "auto",
            "user": None,
            "usage": usage_body(usage) if usage is not None else None,
        }


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [output_text(text)] if status == "completed" else []
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": None}


def function_call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


class EventStream:
    """Numbers the events of one streamed response and frames them as SSE."""

    def __init__(self) -> None:
        self._sequence = 0

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

    def opening(self, response: dict[str, Any], item: dict[str, Any]) -> Iterator[bytes]:
        """`created`, `in_progress`, and the output item (with its text part) opening."""
        yield self.event("response.created", response=response)
        yield self.event("response.in_progress", response=response)
        yield self.event("response.output_item.added", output_index=0, item=item)
        if item["type"] == "message":
            yield self.event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=0,
                content_index=0,
                part=output_text(""),
            )

    def text_delta(self, item_id: str, delta: str) -> bytes:
        return self.event(
            "response.output_text.delta",
            item_id=item_id,
            output_index=0,
            content_index=0,
            delta=delta,
            logprobs=[],
        )

    def closing(self, item: dict[str, Any], response: dict[str, Any]) -> Iterator[bytes]:
        """The output item's `done` events, then `response.completed`."""
        item_id = item["id"]
        if item["type"] == "message":
            text = item["content"][0]["text"]
            yield self.event(
                "response.output_text.done",
                item_id=item_id,
                output_index=0,
                content_index=0,
                text=text,
                logprobs=[],
            )
            yield self.event(
                "response.content_part.done",
                item_id=item_id,
                output_index=0,
                content_index=0,
                part=output_text(text),
            )
        else:
            arguments = item["arguments"]
            yield self.event(
                "response.function_call_arguments.delta",
                item_id=item_id,
                output_index=0,
                delta=arguments,
            )
            yield self.event(
                "response.function_call_arguments.done",
                item_id=item_id,
                output_index=0,
                name=item["name"],
                arguments=arguments,
            )
        yield self.event("response.output_item.done", output_index=0, item=item)
        yield self.event("response.completed", response=response)
