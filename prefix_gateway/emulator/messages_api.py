"""Anthropic's Messages API on the emulated replica, as vLLM serves it (`/v1/messages` and
`/v1/messages/count_tokens`): the request becomes chat messages (the system prompt first, a
user's tool results as tool messages, an assistant's tool calls as its `tool_calls`), runs on
the engine, and is answered in Anthropic's shape. A stream's events come in vLLM's order:
`message_start` (its usage the prompt's tokens), each content block's start, deltas and stop,
`message_delta` with the usage, `message_stop`; vLLM sends no `ping`. The usage is vLLM's with
`--enable-prompt-tokens-details`: `input_tokens` less the tokens read from the cache and
written to it, `cache_read_input_tokens`, `cache_creation_input_tokens` (the prompt's full
blocks that were not cached before). Errors in Anthropic's shape, typed as vLLM's are.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from prefix_gateway.emulator.config import EmulatorConfig
from prefix_gateway.emulator.engine import Engine
from prefix_gateway.emulator.errors import EmulatorError, InvalidRequest
from prefix_gateway.emulator.prompts import chat_prompt_ids
from prefix_gateway.emulator.protocol import check_model, completion_limit, optional_positive_int


def error_body(error: EmulatorError) -> bytes:
    """vLLM's Messages errors: its own error type in Anthropic's envelope."""
    return orjson.dumps(
        {"type": "error", "error": {"type": error.error_type, "message": error.message}}
    )


@dataclass(frozen=True)
class _Request:
    prompt: list[int]
    max_tokens: int
    stream: bool
    call: str | None
    """The tool the answer calls, when `tool_choice` asks for one."""
    cache_salt: str | None


@dataclass(frozen=True)
class _Usage:
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    block_size: int

    def as_dict(self) -> dict[str, int]:
        full_blocks = self.prompt_tokens // self.block_size * self.block_size
        written = max(0, full_blocks - self.cached_tokens)
        return {
            "input_tokens": max(0, self.prompt_tokens - self.cached_tokens - written),
            "output_tokens": self.output_tokens,
            "cache_read_input_tokens": self.cached_tokens,
            "cache_creation_input_tokens": written,
        }


class MessagesAPI:
    def __init__(self, engine: Engine, config: EmulatorConfig) -> None:
        self._engine = engine
        self._config = config
        self._id_prefix = os.urandom(4).hex()
        self._serial = itertools.count()

    def count_tokens(self, body: Mapping[str, Any]) -> bytes:
        check_model(body, self._config)
        tokens = len(self._prompt(body))
        return orjson.dumps(
            {"input_tokens": tokens, "context_management": {"original_input_tokens": tokens}}
        )

    async def create(self, body: Mapping[str, Any]) -> bytes | AsyncIterator[bytes]:
        """The message's JSON, or (streamed) its events."""
        request = self._parse(body)
        message_id = f"chatcmpl-{self._id_prefix}{next(self._serial):08x}"
        if request.stream:
            return self._stream(request, message_id)
        engine = self._engine
        async with engine.run(request.prompt, request.max_tokens, request.cache_salt) as run:
            text = await run.complete()
            usage = _Usage(run.prompt_tokens, run.produced, run.cached_tokens, self._block_size)
        if request.call is None:
            content = [{"type": "text", "text": text}]
        else:
            content = [_tool_use(message_id, request.call, {"input": text})]
        message = {
            **self._head(message_id),
            "content": content,
            "stop_reason": _stop_reason(request, usage.output_tokens),
            "usage": usage.as_dict(),
        }
        return orjson.dumps(message)

    async def _stream(self, request: _Request, message_id: str) -> AsyncIterator[bytes]:
        engine = self._engine
        async with engine.run(request.prompt, request.max_tokens, request.cache_salt) as run:
            opening = {"input_tokens": run.prompt_tokens, "output_tokens": 0}
            head = {**self._head(message_id), "content": [], "stop_reason": None}
            head["stop_sequence"] = None  # vLLM's event keeps it; its whole body leaves it out
            yield _event("message_start", {"message": {**head, "usage": opening}})
            if request.call is None:
                block: dict[str, Any] = {"type": "text", "text": ""}
            else:
                block = _tool_use(message_id, request.call, {})
            yield _event("content_block_start", {"index": 0, "content_block": block})
            parts: list[str] = []
            async for token in run.stream():
                if request.call is None:
                    delta = {"type": "text_delta", "text": token}
                    yield _event("content_block_delta", {"index": 0, "delta": delta})
                parts.append(token)
            if request.call is not None:
                arguments = orjson.dumps({"input": "".join(parts)}).decode()
                delta = {"type": "input_json_delta", "partial_json": arguments}
                yield _event("content_block_delta", {"index": 0, "delta": delta})
            usage = _Usage(run.prompt_tokens, run.produced, run.cached_tokens, self._block_size)
        yield _event("content_block_stop", {"index": 0})
        stopped = {"stop_reason": _stop_reason(request, usage.output_tokens), "stop_sequence": None}
        yield _event("message_delta", {"delta": stopped, "usage": usage.as_dict()})
        yield _event("message_stop", {})

    @property
    def _block_size(self) -> int:
        return self._config.block_size

    def _head(self, message_id: str) -> dict[str, Any]:
        return {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": self._config.model,
        }

    def _parse(self, body: Mapping[str, Any]) -> _Request:
        check_model(body, self._config)
        prompt = self._prompt(body)
        requested = optional_positive_int(body, "max_tokens")
        if requested is None:
            raise InvalidRequest("max_tokens: Field required", param="max_tokens")
        stream = body.get("stream", False)
        if stream is not None and not isinstance(stream, bool):
            raise InvalidRequest("stream must be a boolean", param="stream")
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise InvalidRequest("cache_salt must be a non-empty string", param="cache_salt")
        return _Request(
            prompt,
            completion_limit(len(prompt), requested, self._config, "messages"),
            bool(stream),
            _called(body.get("tools"), body.get("tool_choice")),
            salt,
        )

    def _prompt(self, body: Mapping[str, Any]) -> list[int]:
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise InvalidRequest("tools must be a list", param="tools")
        messages = _chat_messages(body.get("system"), body.get("messages"))
        return chat_prompt_ids(messages, tools or None, self._config.chat_template)


def _event(kind: str, fields: dict[str, Any]) -> bytes:
    data = orjson.dumps({"type": kind, **fields})
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


def _tool_use(message_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    call_id = "toolu_" + message_id.removeprefix("chatcmpl-")
    return {"type": "tool_use", "id": call_id, "name": name, "input": arguments}


def _stop_reason(request: _Request, produced: int) -> str:
    if produced >= request.max_tokens:
        return "max_tokens"
    return "end_turn" if request.call is None else "tool_use"


def _called(tools: Any, tool_choice: Any) -> str | None:
    """The tool the answer must call: the one named, or the first with `any`."""
    if not isinstance(tool_choice, Mapping):
        return None
    if tool_choice.get("type") == "tool" and isinstance(tool_choice.get("name"), str):
        return str(tool_choice["name"])
    if tool_choice.get("type") == "any" and isinstance(tools, list) and tools:
        first = tools[0]
        if isinstance(first, Mapping) and isinstance(first.get("name"), str):
            return str(first["name"])
    return None


def _chat_messages(system: Any, messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list):
        raise InvalidRequest("messages: Input should be a valid list", param="messages")
    chat: list[dict[str, Any]] = []
    if isinstance(system, list):
        system = "".join(
            block["text"]
            for block in system
            if isinstance(block, Mapping) and isinstance(block.get("text"), str)
        )
    if system is not None and not isinstance(system, str):
        raise InvalidRequest("system must be a string or a list of blocks", param="system")
    if system:
        chat.append({"role": "system", "content": system})
    for position, message in enumerate(messages):
        if not isinstance(message, Mapping) or message.get("role") not in (
            "user",
            "assistant",
            "system",
        ):
            raise InvalidRequest(
                f"messages[{position}] must be an object with role user, assistant or system",
                param="messages",
            )
        content = message.get("content")
        if isinstance(content, str):
            chat.append({"role": message["role"], "content": content})
        elif isinstance(content, list):
            chat.extend(_blocks(message["role"], content, position))
        else:
            raise InvalidRequest(
                f"messages[{position}].content must be a string or a list of blocks",
                param="messages",
            )
    return chat


def _blocks(role: str, blocks: list[Any], position: int) -> list[dict[str, Any]]:
    """One message's blocks as chat messages: a user's tool results each a tool message
    first, then the message with its other parts and tool calls."""
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for block in blocks:
        if not isinstance(block, Mapping) or not isinstance(block.get("type"), str):
            raise InvalidRequest(
                f"messages[{position}].content blocks must be objects with a type",
                param="messages",
            )
        kind = block["type"]
        if kind == "text":
            parts.append({"type": "text", "text": block.get("text") or ""})
        elif kind == "tool_use":
            arguments = orjson.dumps(block.get("input") or {}).decode()
            function = {"name": block.get("name") or "", "arguments": arguments}
            calls.append({"id": block.get("id"), "type": "function", "function": function})
        elif kind == "tool_result" and role == "user":
            content = block.get("content")
            results.append({"role": "tool", "content": content if content is not None else ""})
        else:
            # Images and the rest: one token each, named by a digest of the block.
            parts.append(dict(block))
    message: dict[str, Any] = {"role": role, "content": parts}
    if calls:
        message["tool_calls"] = calls
    return [*results, message] if parts or calls or role != "user" else results
