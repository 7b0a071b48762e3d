"""The Responses API's body as routing sees it: `tools`, `instructions`, then `input` (a string
or a list of items) in chat's canonical bytes, so a conversation re-sent whole extends its
previous request's bytes and answer; and the response ids a request names.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from prefix_gateway.errors import BadRequest
from prefix_gateway.prompt.canonical import (
    FIELD,
    MessageStream,
    message_segment,
    tool_calls_field,
    tools_block,
)
from prefix_gateway.prompt.hashing import key_hash

RESPONSE_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
"""What a response id may be: vLLM's are `resp_` and 32 hex digits, OpenAI's `resp_` and hex."""
# Fields of an item that name or describe it without being part of the prompt.
_NOT_PROMPT = frozenset({"id", "status"})


def checked_response_id(value: object, param: str) -> str:
    """`value` if it is a response id (a short token), else a `BadRequest` naming `param`."""
    if not isinstance(value, str) or not RESPONSE_ID.fullmatch(value):
        raise BadRequest(
            f"{param} must be 1 to 128 letters, digits, `_`, `.`, `:` or `-`",
            param=param,
            code="invalid_response_id",
        )
    return value


def response_key(response_id: str, tenant: str | None = None) -> str:
    """What is kept of a response id: a hash, 16 hex digits (a tenant's own)."""
    return f"{key_hash(response_id if tenant is None else f'{tenant}:{response_id}'):016x}"


def responses_canonical(payload: dict[str, Any], max_items: int) -> tuple[bytes, int, bool]:
    """The canonical bytes of a Responses request, where its first user message begins, and
    whether no answer (an assistant message, a function call or its output) follows it."""
    stream = MessageStream()
    tools = payload.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRequest("tools must be a list", param="tools")
    if tools:
        stream.add(tools_block(tools))
    instructions = payload.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise BadRequest("instructions must be a string", param="instructions")
        stream.add(message_segment("system", instructions), "system")
    given = payload.get("input")
    if isinstance(given, str):
        items: list[Any] = [{"role": "user", "content": given}]
    elif isinstance(given, list):
        if len(given) > max_items:
            raise BadRequest(
                f"input holds more than {max_items} items", param="input", code="too_many_items"
            )
        items = given
    else:
        raise BadRequest(
            "input must be a string or a list of items", param="input", code="invalid_type"
        )
    for position, item in enumerate(items):
        if not isinstance(item, dict):
            raise BadRequest(f"input[{position}] must be an object", param="input")
        try:
            segment, role = _item_segment(item)
        except TypeError as exc:
            raise BadRequest(
                f"input[{position}]: {exc}", param="input", code="invalid_type"
            ) from None
        stream.add(segment, role)
    return stream.result()


def _item_segment(item: dict[str, Any]) -> tuple[bytes, str]:
    """One input item as the message an engine renders it as, and that message's role."""
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if not isinstance(role, str):
            raise TypeError("a message needs a string `role`")
        return message_segment(role, item.get("content")), role
    if kind == "function_call":
        call = {name: item.get(name) for name in ("call_id", "name", "arguments")}
        return message_segment("assistant", None, tool_calls_field(call)), "assistant"
    if kind == "function_call_output":
        return message_segment("tool", item.get("output")), "tool"
    if not isinstance(kind, str):
        raise TypeError("an item's `type` must be a string")
    rest = {name: value for name, value in item.items() if name not in _NOT_PROMPT}
    described = FIELD + orjson.dumps(rest, option=orjson.OPT_SORT_KEYS)
    return message_segment(kind, None, described), kind


def chat_messages(payload: dict[str, Any]) -> tuple[list[dict[str, Any]], list[Any] | None] | None:
    """The chat messages and chat-shaped tools an engine renders a Responses request as (vLLM:
    the instructions as a system message, a string input as a user message, items as messages,
    a function call joining the assistant message before it); None where that is not known
    (items other than messages and function calls, content other than text)."""
    messages: list[dict[str, Any]] = []
    instructions = payload.get("instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    given = payload.get("input")
    items = [{"role": "user", "content": given}] if isinstance(given, str) else given
    if not isinstance(items, list):
        return None
    for item in items:
        message = _chat_message(item, messages[-1] if messages else None)
        if message is False:
            return None
        if message is not True:
            messages.append(message)
    tools = payload.get("tools")
    if not tools:
        return messages, None
    if any(not isinstance(tool, dict) or tool.get("type") != "function" for tool in tools):
        return None
    described = ("name", "description", "parameters")
    chat_tools = [
        {"type": "function", "function": {key: tool[key] for key in described if key in tool}}
        for tool in tools
    ]
    return messages, chat_tools


def _chat_message(item: Any, previous: dict[str, Any] | None) -> dict[str, Any] | bool:
    """One item as a chat message; True when it joined `previous`, False when not known."""
    kind = item.get("type", "message")
    assistant = previous if previous is not None and previous.get("role") == "assistant" else None
    if kind == "function_call":
        call = {
            "id": item.get("call_id"),
            "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments")},
        }
        if assistant is not None:
            assistant.setdefault("tool_calls", []).append(call)
            return True
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "function_call_output":
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    if kind != "message":
        return False
    role, content = item.get("role"), item.get("content")
    if isinstance(content, list):
        texts = [part.get("text") for part in content if isinstance(part, dict)]
        strings = [text for text in texts if isinstance(text, str)]
        if not strings or len(strings) < len(content):
            return False
        # An assistant message keeps its first part; other roles' parts are joined by lines.
        content = strings[0] if role == "assistant" else "\n".join(strings)
    if not isinstance(content, str):
        return False
    if role == "assistant" and assistant is not None and assistant.get("content") is None:
        assistant["content"] = content
        return True
    return {"role": role, "content": content}


RESPONSES_PREFIX = "/v1/responses/"
CANCEL = "/cancel"


def response_target(path: str) -> tuple[str, str] | None:
    """`(id, "")` for `/v1/responses/{id}`, `(id, "cancel")` for its `/cancel`, else None;
    the id is not checked yet."""
    if not path.startswith(RESPONSES_PREFIX):
        return None
    rest = path[len(RESPONSES_PREFIX) :]
    if rest.endswith(CANCEL):
        rest, action = rest[: -len(CANCEL)], "cancel"
    else:
        action = ""
    if not rest or "/" in rest:
        return None
    return rest, action
