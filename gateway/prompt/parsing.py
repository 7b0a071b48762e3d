"""Request parsing: OpenAI request bodies into what routing needs, parsed once and never
re-serialised (the bytes go upstream as the client sent them).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

import orjson

from gateway.errors import BadRequest
from gateway.prompt.canonical import (
    message_segment,
    text_prompts,
    token_prompts,
    tool_calls_field,
    tools_block,
)


class Endpoint(Enum):
    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    EMBEDDINGS = "/v1/embeddings"


ENDPOINTS = {endpoint.value: endpoint for endpoint in Endpoint}


@dataclass(frozen=True, slots=True)
class RoutingInput:
    endpoint: Endpoint
    model: str
    canonical: bytes
    # Byte offset where the part that tells requests apart begins (the first user message).
    distinct_from: int
    session_key: str | None
    stream: bool
    wants_usage: bool


def parse_request(
    endpoint: Endpoint,
    body: bytes,
    session_header: str | None,
    default_model: str = "",
    session_from_user: bool = False,
    max_depth: int = 64,
) -> RoutingInput:
    """What routing needs of `body`; a `BadRequest` for anything malformed or nested deeper
    than `max_depth` arrays and objects (checked before anything walks it)."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(payload, dict):
        raise BadRequest("request body must be a JSON object", code="invalid_type")
    _check_depth(payload, body, max_depth)
    model = payload.get("model", default_model or None)
    if model is None or model == "":
        raise BadRequest("you must provide a model parameter", param="model", code="missing_model")
    if not isinstance(model, str):
        raise BadRequest("model must be a string", param="model", code="invalid_type")
    stream = payload.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean", param="stream", code="invalid_type")
    options = payload.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("stream_options must be an object", param="stream_options")
    wants_usage = bool(options and options.get("include_usage"))

    if endpoint is Endpoint.CHAT:
        canonical, distinct_from = _chat_canonical(payload)
    elif endpoint is Endpoint.COMPLETIONS:
        canonical, distinct_from = _completion_canonical(payload.get("prompt"), "prompt"), 0
    else:
        canonical, distinct_from = _completion_canonical(payload.get("input"), "input"), 0

    return RoutingInput(
        endpoint=endpoint,
        model=model,
        canonical=canonical,
        distinct_from=distinct_from,
        session_key=_session_key(payload, session_header, session_from_user),
        stream=bool(stream),
        wants_usage=wants_usage,
    )


def _check_depth(payload: dict[str, Any], body: bytes, limit: int) -> None:
    """Refuse a body nested deeper than `limit`, level by level; for most bodies two byte
    counts (no more brackets than the limit) prove it without a walk."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return
    level: list[Any] = [payload]
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            raise BadRequest(f"request body is nested deeper than {limit} levels", code="too_deep")
        inner: list[Any] = []
        for node in level:
            for child in node.values() if isinstance(node, dict) else node:
                if isinstance(child, dict | list):
                    inner.append(child)
        level = inner


def _session_key(payload: dict[str, Any], header: str | None, from_user: bool) -> str | None:
    if header:
        return header
    key = payload.get("prompt_cache_key")
    if key is not None:
        if not isinstance(key, str):
            raise BadRequest("prompt_cache_key must be a string", param="prompt_cache_key")
        return key or None
    user = payload.get("user")
    if from_user and isinstance(user, str) and user:
        return user
    return None


def _chat_canonical(payload: dict[str, Any]) -> tuple[bytes, int]:
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest(
            "messages must be a non-empty list", param="messages", code="invalid_messages"
        )
    parts: list[bytes] = []
    size = 0
    distinct_from = -1
    tools = payload.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise BadRequest("tools must be a list", param="tools")
        tools_bytes = tools_block(tools)
        parts.append(tools_bytes)
        size += len(tools_bytes)
    for position, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"messages[{position}] must be an object", param="messages")
        role = message.get("role")
        if not isinstance(role, str):
            raise BadRequest(f"messages[{position}].role must be a string", param="messages")
        extra = b""
        tool_calls = message.get("tool_calls")
        if tool_calls is not None:
            extra = tool_calls_field(tool_calls)
        try:
            segment = message_segment(role, message.get("content"), extra)
        except TypeError as exc:
            raise BadRequest(
                f"messages[{position}].content: {exc}", param="messages", code="invalid_type"
            ) from None
        if distinct_from < 0 and role == "user":
            distinct_from = size
        parts.append(segment)
        size += len(segment)
    return b"".join(parts), max(distinct_from, 0)


def _completion_canonical(prompt: Any, name: str) -> bytes:
    if isinstance(prompt, str):
        return prompt.encode()
    if isinstance(prompt, list) and prompt:
        if all(isinstance(item, str) for item in prompt):
            return text_prompts(prompt)
        if all(isinstance(item, int) and not isinstance(item, bool) for item in prompt):
            return token_prompts(prompt)
        if all(isinstance(item, list) for item in prompt):
            return token_prompts(prompt)
    raise BadRequest(
        f"{name} must be a string, a list of strings or a list of token ids",
        param=name,
        code="invalid_type",
    )
