"""The Responses API of the emulated replica, with vLLM's semantics: a stored response (`store`,
on by default) is kept in this replica's memory only; a follow-up naming it with
`previous_response_id` continues its conversation (its messages, less the system one, then its
output, after the new `instructions`); one naming a response this replica does not hold gets
vLLM's 404. `GET`, `DELETE` and `cancel` answer for stored responses.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from prefix_gateway.emulator.bodies import Usage
from prefix_gateway.emulator.config import EmulatorConfig
from prefix_gateway.emulator.engine import Engine
from prefix_gateway.emulator.errors import InvalidRequest, InvalidResponseRequest, ResponseNotFound
from prefix_gateway.emulator.prompts import chat_prompt_ids
from prefix_gateway.emulator.protocol import check_model, completion_limit, optional_positive_int
from prefix_gateway.emulator.response_objects import (
    EventStream,
    ResponseHead,
    function_call_item,
    message_item,
)

STORED_MAX = 4096
"""Responses kept at most (vLLM keeps every one; a bound keeps long runs of tests flat)."""
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


@dataclass
class _Stored:
    messages: list[dict[str, Any]]
    """The chat messages the response was generated from."""
    response: dict[str, Any]


@dataclass(frozen=True)
class _Request:
    head: ResponseHead
    messages: list[dict[str, Any]]
    prompt: list[int]
    max_tokens: int
    stream: bool
    call: str | None
    """The function the output calls, when `tool_choice` asks for one."""
    cache_salt: str | None


class ResponsesAPI:
    def __init__(self, engine: Engine, config: EmulatorConfig) -> None:
        self._engine = engine
        self._config = config
        self._stored: OrderedDict[str, _Stored] = OrderedDict()
        self._id_prefix = os.urandom(4).hex()
        self._serial = itertools.count()

    async def create(self, body: Mapping[str, Any]) -> bytes | AsyncIterator[bytes]:
        """The response's JSON, or (streamed) its events."""
        request = self._parse(body)
        if request.stream:
            return self._stream(request)
        async with self._engine.run(request.prompt, request.max_tokens, request.cache_salt) as run:
            text = await run.complete()
            usage = Usage(run.prompt_tokens, run.produced, run.cached_tokens)
        item = self._output(request, text)
        response = request.head.body(_status(usage, request), [item], usage)
        self._store(request, response)
        return orjson.dumps(response)

    def retrieve(self, response_id: str) -> bytes:
        return orjson.dumps(self._held(response_id).response)

    def delete(self, response_id: str) -> bytes:
        self._held(response_id)
        del self._stored[response_id]
        return orjson.dumps({"id": response_id, "object": "response.deleted", "deleted": True})

    def cancel(self, response_id: str) -> bytes:
        """vLLM's answer: only a background response can be cancelled, and there are none."""
        self._held(response_id)
        raise InvalidResponseRequest("Cannot cancel a synchronous response.", param="response_id")

    async def _stream(self, request: _Request) -> AsyncIterator[bytes]:
        events = EventStream()
        head = request.head
        opening = self._output(request, "", "in_progress")
        for event in events.opening(head.body("in_progress", [], None), opening):
            yield event
        parts: list[str] = []
        async with self._engine.run(request.prompt, request.max_tokens, request.cache_salt) as run:
            async for token in run.stream():
                parts.append(token)
                if request.call is None:
                    yield events.text_delta(opening["id"], token)
            usage = Usage(run.prompt_tokens, run.produced, run.cached_tokens)
        item = self._output(request, "".join(parts))
        response = head.body(_status(usage, request), [item], usage)
        self._store(request, response)
        for event in events.closing(item, response):
            yield event

    def _parse(self, body: Mapping[str, Any]) -> _Request:
        config = self._config
        check_model(body, config)
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise InvalidRequest("instructions must be a string", param="instructions")
        tools = body.get("tools") or []
        if not isinstance(tools, list):
            raise InvalidRequest("tools must be a list", param="tools")
        previous = body.get("previous_response_id")
        messages: list[dict[str, Any]] = []
        if instructions:
            messages.append({"role": "system", "content": instructions})
        if previous is not None:
            if not isinstance(previous, str):
                raise InvalidRequest(
                    "previous_response_id must be a string", param="previous_response_id"
                )
            earlier = self._held(previous)
            messages.extend(m for m in earlier.messages if m.get("role") != "system")
            messages.extend(_output_messages(earlier.response["output"]))
        messages.extend(_input_messages(body.get("input")))
        prompt = chat_prompt_ids(messages, tools or None, config.chat_template)
        requested = optional_positive_int(body, "max_output_tokens")
        stream = body.get("stream", False)
        store = body.get("store", True)
        if not isinstance(stream, bool) or not isinstance(store, bool):
            raise InvalidRequest("stream and store must be booleans")
        tool_choice = body.get("tool_choice", "auto")
        head = ResponseHead(
            id=f"resp_{self._id_prefix}{next(self._serial):024x}",
            created_at=int(time.time()),
            model=config.model,
            instructions=instructions,
            tools=tools,
            tool_choice=tool_choice,
            max_output_tokens=requested,
            previous_response_id=previous,
            store=store,
        )
        salt = body.get("cache_salt")
        return _Request(
            head,
            messages,
            prompt,
            completion_limit(len(prompt), requested, config, "input"),
            stream,
            _called(tools, tool_choice),
            salt if isinstance(salt, str) and salt and config.honour_cache_salt else None,
        )

    def _output(self, request: _Request, text: str, status: str = "completed") -> dict[str, Any]:
        serial = request.head.id.removeprefix("resp_")
        if request.call is None:
            return message_item(f"msg_{serial}", text, status)
        arguments = orjson.dumps({"input": text}).decode() if status == "completed" else ""
        return function_call_item(f"fc_{serial}", f"call_{serial}", request.call, arguments, status)

    def _store(self, request: _Request, response: dict[str, Any]) -> None:
        if not request.head.store:
            return
        self._stored[request.head.id] = _Stored(request.messages, response)
        while len(self._stored) > STORED_MAX:
            self._stored.popitem(last=False)

    def _held(self, response_id: str) -> _Stored:
        stored = self._stored.get(response_id)
        if stored is None:
            raise ResponseNotFound(response_id)
        return stored


def _status(usage: Usage, request: _Request) -> str:
    return "incomplete" if usage.completion_tokens >= request.max_tokens else "completed"


def _called(tools: list[Any], tool_choice: Any) -> str | None:
    """The function the output must call: the one named, or the first with `required`."""
    if isinstance(tool_choice, Mapping) and isinstance(tool_choice.get("name"), str):
        return str(tool_choice["name"])
    if tool_choice == "required":
        for tool in tools:
            if isinstance(tool, Mapping) and isinstance(tool.get("name"), str):
                return str(tool["name"])
    return None


def _input_messages(given: object) -> list[dict[str, Any]]:
    """The chat messages of `input`, as vLLM renders its items."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not isinstance(given, list):
        raise InvalidRequest("input must be a string or a list of items", param="input")
    messages: list[dict[str, Any]] = []
    for position, item in enumerate(given):
        if not isinstance(item, Mapping):
            raise InvalidRequest(f"input[{position}] must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _content(item.get("content"))})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")},
            }
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _content(output)
            messages.append(
                {"role": "tool", "tool_call_id": item.get("call_id"), "content": content}
            )
        else:
            raise InvalidRequest(
                f"input[{position}]: unsupported item type {kind!r}", param="input"
            )
    return messages


def _content(content: object) -> object:
    """Text parts of the Responses API (`input_text`, `output_text`) as chat's `text` parts."""
    if not isinstance(content, list):
        return content
    return [
        {"type": "text", "text": part.get("text")}
        if isinstance(part, Mapping) and part.get("type") in _TEXT_PARTS
        else part
        for part in content
    ]


def _output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stored response's output as the messages a follow-up continues from (vLLM carries
    only its text messages)."""
    return [
        {"role": "assistant", "content": part["text"]}
        for item in output
        if item.get("type") == "message"
        for part in item.get("content", [])
    ]
