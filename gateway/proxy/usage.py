"""Reading what a response says about the cache: usage, cached tokens and the answer text, in
the shapes of chat and completions and of the Responses API (its id too).

Responses are relayed untouched, except that a stream whose usage the gateway asked for itself
(`--observe-usage`) loses its usage-only event (docs/routing.md).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import orjson

_HOLD_MAX = 1 << 20  # bytes of one unfinished event held back at most while stripping usage
# An event ends at a blank line; lines end in LF or CRLF (sse-starlette's default).
_BLANK_LINE = re.compile(rb"\r?\n\r?\n")


@dataclass(slots=True)
class Observation:
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    answer_parts: list[str] = field(default_factory=list)
    sent_at: float = math.inf
    """`time.perf_counter()` when the request went to the replica that answered (inf: unknown)."""
    complete: bool = False
    """A stream's `data: [DONE]` (or `response.completed`) went by: the client has it all."""
    response_id: str | None = None
    """A Responses API response's id."""
    completion_tokens: int | None = None

    @property
    def answer(self) -> str:
        return "".join(self.answer_parts)

    def take_usage(self, usage: Any) -> None:
        """Chat's usage (`prompt_tokens`...) or the Responses API's (`input_tokens`...)."""
        if not isinstance(usage, dict):
            return
        prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
        if isinstance(prompt, int):
            self.prompt_tokens = prompt
        completion = usage.get("completion_tokens", usage.get("output_tokens"))
        if isinstance(completion, int):
            self.completion_tokens = completion
        details = usage.get("prompt_tokens_details", usage.get("input_tokens_details"))
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            self.cached_tokens = details["cached_tokens"]

    def take_response(self, response: Any) -> None:
        """A Responses API response object: its id, usage and first message's text."""
        if not isinstance(response, dict):
            return
        if isinstance(response.get("id"), str):
            self.response_id = response["id"]
        self.take_usage(response.get("usage"))
        for item in response.get("output") or ():
            if isinstance(item, dict) and item.get("type") == "message":
                for part in item.get("content") or ():
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        self.answer_parts.append(part["text"])
                return


def observe_body(body: bytes) -> Observation:
    """Usage and the first choice's text from a non-streamed response."""
    seen = Observation()
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        return seen
    if not isinstance(payload, dict):
        return seen
    if payload.get("object") == "response":
        seen.take_response(payload)
        return seen
    seen.take_usage(payload.get("usage"))
    choices = payload.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        message = choices[0].get("message")
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            seen.answer_parts.append(message["content"])
    return seen


class StreamObserver:
    """Follows SSE events across chunk boundaries. `feed` returns what the client is to get:
    each chunk as it came, or with `strip_usage` the complete events less the usage-only one."""

    def __init__(self, strip_usage: bool = False) -> None:
        self.seen = Observation()
        self._strip_usage = strip_usage
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._pending + chunk if self._pending else chunk
        strip = self._strip_usage
        kept: list[bytes] = []
        if strip or b"\r" in data:
            start = 0
            for blank in _BLANK_LINE.finditer(data):
                end = blank.end()
                if not self._event(data[start : blank.start()]) and strip:
                    kept.append(data[start:end])
                start = end
            self._pending = data[start:]
        else:
            # Plain LF events, relayed untouched (the usual stream): a split beats the pattern.
            events = data.split(b"\n\n")
            self._pending = events.pop()
            for event in events:
                self._event(event)
        if not strip:
            if len(self._pending) > _HOLD_MAX:
                self._pending = b""  # not SSE as expected: stop following this event
            return chunk
        if len(self._pending) > _HOLD_MAX:
            # Not an SSE stream as expected: stop holding bytes back.
            self._strip_usage = False
            kept.append(self._pending)
            self._pending = b""
        return b"".join(kept)

    def finish(self) -> bytes:
        """Once the stream has ended: its last event if no blank line closed it (returned while
        stripping unless usage-only)."""
        rest, self._pending = self._pending, b""
        if self._event(rest) or not self._strip_usage:
            return b""
        return rest

    def rest(self) -> bytes:
        """What `feed` still holds back once the stream broke off: an event cut short."""
        if not self._strip_usage:
            return b""
        rest, self._pending = self._pending, b""
        return rest

    def _event(self, event: bytes) -> bool:
        """Take in one event; True when it carries usage only."""
        usage_only = False
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if not payload.startswith(b"{"):
                if payload == b"[DONE]":
                    self.seen.complete = True
                continue
            try:
                message = orjson.loads(payload)
            except orjson.JSONDecodeError:
                continue
            if not isinstance(message, dict):
                continue
            kind = message.get("type")
            if isinstance(kind, str) and kind.startswith("response."):
                self._response_event(kind, message)
                continue
            choices = message.get("choices")
            if message.get("usage"):
                self.seen.take_usage(message["usage"])
                # OpenAI's usage chunk has `choices: []`; some servers leave the key out.
                usage_only = choices is None or choices == []
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
        return usage_only

    def _response_event(self, kind: str, message: dict[str, Any]) -> None:
        """One of the Responses API's typed events."""
        seen = self.seen
        if kind == "response.output_text.delta":
            if isinstance(message.get("delta"), str):
                seen.answer_parts.append(message["delta"])
        elif kind == "response.created":
            response = message.get("response")
            if isinstance(response, dict) and isinstance(response.get("id"), str):
                seen.response_id = response["id"]
        elif kind in _RESPONSE_ENDS:
            response = message.get("response")
            if isinstance(response, dict):
                seen.take_usage(response.get("usage"))
            seen.complete = True


_RESPONSE_ENDS = frozenset({"response.completed", "response.incomplete", "response.failed"})
