"""The Responses API's body as routing sees it: `tools`, `instructions`, then `input` (a string
or a list of items) in chat's canonical bytes, so a conversation re-sent whole extends its
previous request's bytes and answer; and the response ids a request names.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from gateway.errors import BadRequest
from gateway.prompt.canonical import FIELD, message_segment, tool_calls_field, tools_block
from gateway.prompt.hashing import key_hash

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


def responses_canonical(payload: dict[str, Any], max_items: int) -> tuple[bytes, int]:
    """The canonical bytes of a Responses request and where its first user message begins."""
    parts: list[bytes] = []
    tools = payload.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRequest("tools must be a list", param="tools")
    if tools:
        parts.append(tools_block(tools))
    instructions = payload.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise BadRequest("instructions must be a string", param="instructions")
        parts.append(message_segment("system", instructions))
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
    size = sum(len(part) for part in parts)
    distinct_from = -1
    for position, item in enumerate(items):
        if not isinstance(item, dict):
            raise BadRequest(f"input[{position}] must be an object", param="input")
        try:
            segment, role = _item_segment(item)
        except TypeError as exc:
            raise BadRequest(
                f"input[{position}]: {exc}", param="input", code="invalid_type"
            ) from None
        if distinct_from < 0 and role == "user":
            distinct_from = size
        parts.append(segment)
        size += len(segment)
    return b"".join(parts), max(distinct_from, 0)


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
