"""The canonical prompt stream: the bytes routing hashes, one format for every endpoint. The
same messages give the same bytes and one more message only appends bytes, as an engine's
cache sees it; a batch is marked so it is never taken for one long prompt.

    chat        [TOOLS "tools" FIELD json] (MESSAGE role FIELD content [FIELD tool_calls])*
    content     text, and PART json for a part that is not text (images, audio, files)
    responses   as chat: `instructions` a system message, then each input item a message
                (a function call an assistant's FIELD json, its output a tool's content)
    messages    as chat: `system` a system message, then each message's blocks (text as its
                text, a `tool_use` FIELD json, a user's `tool_result` a tool message of its own)
    completion  text | TOKENS json
    batch       text (MESSAGE text)+ | TOKENS json of lists
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson

from prefix_gateway.errors import BadRequest

MESSAGE = b"\x1e"
"""Begins each chat message; separates the prompts of a batch."""
FIELD = b"\x1f"
FIELD_TEXT = FIELD.decode()
"""Where an answer's text ends and a tool call it made begins (a Messages answer's)."""
TOOLS = b"\x1d"
TOKENS = b"\x1c"
PART = b"\x1a"
_ASKING_ROLES = frozenset({"system", "developer", "user"})
"""Roles of the messages a client writes; any other (an assistant's answer, a tool's output, a
Responses item such as reasoning) after the first user message is an earlier turn's."""
_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})
"""Part types an engine renders as their text (the last two are the Responses API's)."""


def message_segment(role: str, content: Any, extra: bytes = b"") -> bytes:
    """The canonical bytes of one chat message (also used for the answer once it is known)."""
    return MESSAGE + role.encode() + FIELD + _content_bytes(content) + extra


class MessageStream:
    """A chat-shaped prompt's canonical bytes, built part by part, with where its first user
    message begins and whether an earlier turn's answer follows that message."""

    __slots__ = ("_answered", "_distinct_from", "_parts", "_size")

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._size = 0
        self._distinct_from = -1
        self._answered = False

    def add(self, segment: bytes, role: str | None = None) -> None:
        """Append `segment`: a message of `role`, or (None) what precedes the messages."""
        if role is not None:
            if self._distinct_from < 0:
                if role == "user":
                    self._distinct_from = self._size
            elif role not in _ASKING_ROLES:
                self._answered = True
        self._parts.append(segment)
        self._size += len(segment)

    def result(self) -> tuple[bytes, int, bool]:
        """The bytes, where the first user message begins (0 without one), and whether the
        prompt is a first turn: no answer follows its first user message."""
        return b"".join(self._parts), max(self._distinct_from, 0), not self._answered


def checked_messages(payload: dict[str, Any], max_messages: int) -> list[Any]:
    """A body's `messages`: a non-empty list of at most `max_messages`, else a `BadRequest`."""
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest(
            "messages must be a non-empty list", param="messages", code="invalid_messages"
        )
    if len(messages) > max_messages:
        raise BadRequest(
            f"more than {max_messages} messages", param="messages", code="too_many_messages"
        )
    return messages


def message_role(message: Any, position: int) -> str:
    """The role of `messages[position]`, an object with a string role, else a `BadRequest`."""
    if not isinstance(message, dict):
        raise BadRequest(f"messages[{position}] must be an object", param="messages")
    role = message.get("role")
    if not isinstance(role, str):
        raise BadRequest(f"messages[{position}].role must be a string", param="messages")
    return role


def tools_block(tools: list[Any]) -> bytes:
    return TOOLS + b"tools" + FIELD + orjson.dumps(tools, option=orjson.OPT_SORT_KEYS)


def tool_calls_field(tool_calls: Any) -> bytes:
    return FIELD + orjson.dumps(tool_calls, option=orjson.OPT_SORT_KEYS)


def message_spans(canonical: bytes) -> Iterator[tuple[int, int]]:
    """The byte span of each message of a chat's stream, the tools block first if it has one;
    a message's span starts at its role's first byte."""
    find = canonical.find
    start = find(MESSAGE)
    head = start if start >= 0 else len(canonical)
    if head:
        yield 0, head
    while start >= 0:
        end = find(MESSAGE, start + 1)
        yield start + 1, end if end >= 0 else len(canonical)
        start = end


def is_batch(canonical: bytes) -> bool:
    """Whether a completion's stream holds several prompts (each cached on its own)."""
    return canonical.startswith(TOKENS + b"[[") or MESSAGE in canonical


def text_prompts(prompts: list[str]) -> bytes:
    return prompts[0].encode() if len(prompts) == 1 else MESSAGE.join(p.encode() for p in prompts)


def token_prompts(ids: list[Any]) -> bytes:
    return TOKENS + orjson.dumps(ids)


def _content_bytes(content: Any) -> bytes:
    if content is None:
        return b""
    if isinstance(content, str):
        return content.encode()
    if isinstance(content, bytes):  # already canonical (a Messages body's blocks)
        return content
    if isinstance(content, list):
        chunks: list[bytes] = []
        for part in content:
            if not isinstance(part, dict):
                raise TypeError("content parts must be objects")
            kind = part.get("type")
            if kind in _TEXT_PARTS:
                text = part.get("text")
                if not isinstance(text, str):
                    raise TypeError("a text part needs a string `text`")
                chunks.append(text.encode())
            else:
                # Images, audio and files cache by their bytes; their serialised form stands
                # in for them.
                chunks.append(PART + orjson.dumps(part, option=orjson.OPT_SORT_KEYS))
        return b"".join(chunks)
    raise TypeError("content must be a string, a list of parts or null")
