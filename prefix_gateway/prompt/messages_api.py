"""The Anthropic Messages API's body as routing sees it: `tools`, `system` (a string or text
blocks), then `messages` with their content blocks, in chat's canonical bytes, so that a
conversation's next turn extends its previous prompt and answer; the session key a client gives
in `metadata.user_id`; and the chat messages an engine renders the body as (vLLM's rules), which
`--tokenizer` encodes.

What an engine never sees is left out, so that it does not tell equal prompts apart: a block's
`cache_control` (clients move it along the conversation every turn) and a system block that is
Claude Code's per-request billing header (vLLM drops it).
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from prefix_gateway.errors import BadRequest
from prefix_gateway.prompt.canonical import (
    FIELD,
    PART,
    MessageStream,
    checked_messages,
    message_role,
    message_segment,
    tools_block,
)

_BILLING_HEADER = "x-anthropic-billing-header"
"""How a system block begins that carries a per-request hash (dropped by the engine)."""
_NOT_PROMPT = frozenset({"cache_control"})
_SKIPPED = frozenset({"redacted_thinking", "tool_reference"})
"""Blocks the engine drops from a message."""
_TOOL_ROLE = "tool"
"""The role of a tool's result in the canonical stream, as in chat's."""


def messages_canonical(payload: dict[str, Any], max_messages: int) -> tuple[bytes, int, bool]:
    """The canonical bytes of a Messages request, where its first user message begins, and
    whether no answer (an assistant message or a tool's result) follows it."""
    messages = checked_messages(payload, max_messages)
    stream = MessageStream()
    tools = payload.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRequest("tools must be a list", param="tools")
    if tools:
        stream.add(tools_block([_without_markers(tool) for tool in tools]))
    system = payload.get("system")
    if system is not None:
        try:
            text = system_text(system)
        except TypeError as exc:
            raise BadRequest(f"system: {exc}", param="system", code="invalid_type") from None
        if text:
            stream.add(message_segment("system", text), "system")
    for position, message in enumerate(messages):
        role = message_role(message, position)
        try:
            _add_message(stream, role, message.get("content"))
        except TypeError as exc:
            raise BadRequest(
                f"messages[{position}].content: {exc}", param="messages", code="invalid_type"
            ) from None
    return stream.result()


def system_text(system: Any) -> str:
    """The system prompt as the engine has it: the string, or its text blocks joined."""
    if isinstance(system, str):
        return "" if _billing(system) else system
    if not isinstance(system, list):
        raise TypeError("must be a string or a list of text blocks")
    texts = []
    for block in system:
        if not isinstance(block, dict):
            raise TypeError("blocks must be objects")
        text = block.get("text")
        if block.get("type") == "text" and isinstance(text, str) and not _billing(text):
            texts.append(text)
    return "".join(texts)


def _billing(text: str) -> bool:
    return text.startswith(_BILLING_HEADER)


def _add_message(stream: MessageStream, role: str, content: Any) -> None:
    """One message: a user's tool results first, each a message of its own (the engine's
    order), then what else it holds (a user message holding nothing else is left out)."""
    if role == "system":
        text = system_text(content)
        if text:
            stream.add(message_segment("system", text), "system")
        return
    if isinstance(content, str):
        stream.add(message_segment(role, content), role)
        return
    if not isinstance(content, list):
        raise TypeError("must be a string or a list of blocks")
    chunks: list[bytes] = []
    for block in content:
        if not isinstance(block, dict):
            raise TypeError("blocks must be objects")
        kind = block.get("type")
        if kind == "tool_result" and role == "user":
            result = _blocks_bytes(_result_blocks(block.get("content")))
            used = block.get("tool_use_id")
            named = FIELD + (used.encode() if isinstance(used, str) else b"")
            stream.add(message_segment(_TOOL_ROLE, result, named), _TOOL_ROLE)
        else:
            chunks.append(_block_bytes(block))
    if chunks or role != "user":
        stream.add(message_segment(role, b"".join(chunks)), role)


def tool_use_field(block: dict[str, Any]) -> bytes:
    """A `tool_use` block's canonical bytes: its id, name and input (also an answer's)."""
    call = {name: block.get(name) for name in ("id", "name", "input")}
    return FIELD + orjson.dumps(call, option=orjson.OPT_SORT_KEYS)


def _result_blocks(content: Any) -> list[Any]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list):
        return content
    raise TypeError("a tool_result's content must be a string or a list of blocks")


def _blocks_bytes(blocks: list[Any]) -> bytes:
    for block in blocks:
        if not isinstance(block, dict):
            raise TypeError("blocks must be objects")
    return b"".join(_block_bytes(block) for block in blocks)


def _block_bytes(block: dict[str, Any]) -> bytes:
    kind = block.get("type")
    if kind == "text":
        text = block.get("text")
        if not isinstance(text, str):
            raise TypeError("a text block needs a string `text`")
        return text.encode()
    if kind == "tool_use":
        return tool_use_field(block)
    # Images (by reference or inline), thinking and the rest: their serialised form stands in.
    return PART + orjson.dumps(_without_markers(block), option=orjson.OPT_SORT_KEYS)


def _without_markers(value: Any) -> Any:
    if isinstance(value, dict) and not _NOT_PROMPT.isdisjoint(value):
        return {name: item for name, item in value.items() if name not in _NOT_PROMPT}
    return value


def user_id(payload: dict[str, Any]) -> str | None:
    """The client's `metadata.user_id` (None when it gives none)."""
    metadata = payload.get("metadata")
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise BadRequest("metadata must be an object", param="metadata", code="invalid_type")
    given = metadata.get("user_id")
    if given is not None and not isinstance(given, str):
        raise BadRequest(
            "metadata.user_id must be a string", param="metadata.user_id", code="invalid_type"
        )
    return given or None


class _Unknown(Exception):
    """Something whose rendering by the engine is not known here."""


def chat_messages(
    payload: dict[str, Any], merge_inline_system: bool
) -> tuple[list[dict[str, Any]], list[Any] | None] | None:
    """The chat messages and tools vLLM renders a Messages request as (its
    `to_chat_completion_request`); None where that is not known here (images, tool changes, a
    tool call without an id). `merge_inline_system`: the chat template takes a system message
    only first, so vLLM moves later ones into it."""
    try:
        return _chat_messages(payload, merge_inline_system)
    except (_Unknown, TypeError, AttributeError, KeyError, ValueError):
        return None  # left for the engine to refuse


def _chat_messages(
    payload: dict[str, Any], merge_inline_system: bool
) -> tuple[list[dict[str, Any]], list[Any] | None]:
    messages: list[dict[str, Any]] = []
    given: list[Any] = payload["messages"]
    system = payload.get("system")
    parts = [system_text(system)] if system else []
    if merge_inline_system:
        parts += [system_text(m["content"]) for m in given if m.get("role") == "system"]
    if any(parts):
        messages.append({"role": "system", "content": "".join(parts)})
    for message in given:
        role, content = message["role"], message["content"]
        if role == "system":
            text = "" if merge_inline_system else system_text(content)
            if text:
                messages.append({"role": "system", "content": text})
            continue
        chat: dict[str, Any] = {"role": role}
        if isinstance(content, str):
            chat["content"] = content
        else:
            _convert_blocks(role, content, chat, messages)
        if role != "user" or "content" in chat:
            messages.append(chat)
    return messages, _chat_tools(payload.get("tools"))


def _convert_blocks(
    role: str, blocks: list[Any], chat: dict[str, Any], messages: list[dict[str, Any]]
) -> None:
    texts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in blocks:
        kind = block.get("type")
        if kind == "text":
            if block.get("text"):
                texts.append({"type": "text", "text": block["text"]})
        elif kind == "thinking":
            if block.get("thinking") is not None:
                reasoning.append(block["thinking"])
        elif kind == "tool_use":
            if not block.get("id"):
                raise _Unknown  # the engine names it by the clock
            arguments = json.dumps(block.get("input") or {})
            function = {"name": block.get("name") or "", "arguments": arguments}
            calls.append({"id": block["id"], "type": "function", "function": function})
        elif kind == "tool_result":
            result = block.get("content")
            if role != "user":
                texts.append({"type": "text", "text": f"Tool result: {result or ''!s}"})
                continue
            if isinstance(result, list):
                if any(item.get("type") in ("image", "tool_reference") for item in result):
                    raise _Unknown
                result = "\n".join(item.get("text", "") for item in result if _is_text(item))
            used = block.get("tool_use_id") or ""
            messages.append({"role": "tool", "tool_call_id": used, "content": result or ""})
        elif kind not in _SKIPPED:
            raise _Unknown  # images, tool changes: not rendered here
    if reasoning:
        chat["reasoning"] = "".join(reasoning)
    if calls:
        chat["tool_calls"] = calls
    if len(texts) == 1:
        chat["content"] = texts[0]["text"]
    elif texts:
        chat["content"] = texts


def _is_text(item: Any) -> bool:
    return isinstance(item, dict) and item.get("type") == "text"


def _chat_tools(tools: Any) -> list[Any] | None:
    """Anthropic's tools as the chat tools vLLM hands the template."""
    if tools is None:
        return None
    chat_tools = []
    for tool in tools:
        schema = dict(tool["input_schema"])
        schema.setdefault("type", "object")
        function = {
            "name": tool["name"],
            "description": tool.get("description"),
            "parameters": schema,
        }
        for optional in ("strict", "defer_loading"):
            if tool.get(optional) is not None:
                function[optional] = tool[optional]
        chat_tool: dict[str, Any] = {"type": "function", "function": function}
        if tool.get("defer_loading") is not None:
            chat_tool["defer_loading"] = tool["defer_loading"]
        chat_tools.append(chat_tool)
    return chat_tools
