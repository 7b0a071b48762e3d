"""Reading what a response says about the cache: usage, cached tokens and the answer text.

The response is relayed untouched; this only looks at it. For streams it follows the SSE
events as they pass, so the answer is known once the stream ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson


@dataclass(slots=True)
class Observation:
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    answer_parts: list[str] = field(default_factory=list)

    @property
    def answer(self) -> str:
        return "".join(self.answer_parts)

    def take_usage(self, usage: Any) -> None:
        if not isinstance(usage, dict):
            return
        prompt = usage.get("prompt_tokens")
        if isinstance(prompt, int):
            self.prompt_tokens = prompt
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            self.cached_tokens = details["cached_tokens"]


def observe_body(body: bytes) -> Observation:
    """Usage and the first choice's text from a non-streamed response."""
    seen = Observation()
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        return seen
    if not isinstance(payload, dict):
        return seen
    seen.take_usage(payload.get("usage"))
    choices = payload.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        message = choices[0].get("message")
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            seen.answer_parts.append(message["content"])
    return seen


class StreamObserver:
    """Follows SSE events across arbitrary chunk boundaries."""

    def __init__(self) -> None:
        self.seen = Observation()
        self._pending = b""

    def feed(self, chunk: bytes) -> None:
        data = self._pending + chunk if self._pending else chunk
        events = data.split(b"\n\n")
        self._pending = events.pop()
        for event in events:
            self._event(event)

    def _event(self, event: bytes) -> None:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if not payload.startswith(b"{"):
                continue
            try:
                message = orjson.loads(payload)
            except orjson.JSONDecodeError:
                continue
            if not isinstance(message, dict):
                continue
            if message.get("usage"):
                self.seen.take_usage(message["usage"])
            choices = message.get("choices")
            if (
                isinstance(choices, list)
                and choices
                and isinstance(choices[0], dict)
                and choices[0].get("index", 0) == 0
            ):
                delta = choices[0].get("delta")
                if isinstance(delta, dict):
                    content = delta.get("content")
                    if isinstance(content, str):
                        self.seen.answer_parts.append(content)
