"""Prompt token ids of chat messages and completion prompts.

Each message is tokenized on its own, so a message boundary is a token boundary. Template
"plain" adds nothing; "chatml" wraps each message in `<|im_start|>`, its role, a newline and
`<|im_end|>` (one token each) and ends with the generation prompt. Tools lead as one message.
"""

from __future__ import annotations

from collections.abc import Mapping

import orjson
import xxhash

from prefix_gateway.emulator.errors import InvalidRequest
from prefix_gateway.emulator.tokenizer import encode, token_id

_IM_START = "<|im_start|>"
_IM_END = "<|im_end|>"
_MAX_TOKEN_ID = 0xFFFF_FFFF


def chat_prompt_ids(messages: object, tools: object, template: str) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    turns: list[tuple[str, list[int]]] = []
    if tools is not None:
        turns.append(("tools", encode(_json_text(tools))))
    for index, message in enumerate(messages):
        turns.append(_message_tokens(message, f"messages[{index}]"))
    if template == "chatml":
        return _chatml(turns)
    return [token for _, content in turns for token in content]


def completion_prompts(prompt: object, param: str = "prompt") -> list[list[int]]:
    """One token-id list per prompt: a string, token ids, or a list of either."""
    if isinstance(prompt, str):
        return [encode(prompt)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(item, str) for item in prompt):
            return [encode(item) for item in prompt]
        if _is_token_list(prompt):
            return [list(prompt)]
        if all(_is_token_list(item) for item in prompt):
            return [list(item) for item in prompt]
    raise InvalidRequest(
        f"{param} must be a string, a list of strings, a list of token ids or a list of such "
        "lists, none of them empty, with token ids between 0 and 2**32-1",
        param=param,
    )


def _is_token_list(value: object) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(
            isinstance(item, int) and not isinstance(item, bool) and 0 <= item <= _MAX_TOKEN_ID
            for item in value
        )
    )


def _message_tokens(message: object, where: str) -> tuple[str, list[int]]:
    if not isinstance(message, Mapping):
        raise InvalidRequest(f"{where} must be an object", param="messages")
    role = message.get("role")
    if not isinstance(role, str):
        raise InvalidRequest(f"{where}.role must be a string", param="messages")
    tokens = content_ids(message.get("content"), where)
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        tokens.extend(encode(_json_text(tool_calls)))
    return role, tokens


def content_ids(content: object, where: str, param: str = "messages") -> list[int]:
    """The ids of a message's content: a string, or a list of parts (text, or one token per
    image, audio or file part)."""
    if content is None:
        return []
    if isinstance(content, str):
        return encode(content)
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}.content must be a string or a list", param=param)
    tokens: list[int] = []
    for part in content:
        if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
            raise InvalidRequest(f"{where}.content parts must be objects with a type", param=param)
        if part["type"] == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidRequest(f"{where}.content text must be a string", param=param)
            tokens.extend(encode(text))
        else:
            # Images, audio and files are one token each, named by a digest of the part.
            digest = xxhash.xxh64_hexdigest(orjson.dumps(part, option=orjson.OPT_SORT_KEYS))
            tokens.append(token_id(f"<{part['type']}:{digest}>"))
    return tokens


def _chatml(turns: list[tuple[str, list[int]]]) -> list[int]:
    start, end, newline = token_id(_IM_START), token_id(_IM_END), token_id("\n")
    ids: list[int] = []
    for role, content in turns:
        ids.append(start)
        ids.extend(encode(role))
        ids.append(newline)
        ids.extend(content)
        ids.append(end)
    ids.append(start)
    ids.extend(encode("assistant"))
    ids.append(newline)
    return ids


def _json_text(value: object) -> str:
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
    except TypeError as exc:
        raise InvalidRequest(f"cannot serialise {type(value).__name__}") from exc
