"""Reading what a response says about the cache: usage, cached tokens and the answer text, in
the shapes of chat and completions, of the Responses API (its id too) and of Anthropic's
Messages API (`prefix_gateway.proxy.messages_events`).

Responses are relayed untouched, except that a stream whose usage the gateway asked for itself
(`--observe-usage`) loses its usage-only event (docs/routing.md).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import orjson

from prefix_gateway.proxy.messages_events import MESSAGE_EVENTS, MessageEvents, answer_parts

_HOLD_MAX = 1 << 20  # bytes of one unfinished event held back at most while stripping usage
_JOINED_EVERY = 256  # answer parts joined into one string past this many (a delta is tiny)
_OPENING_ID = re.compile(rb'\A\s*\{\s*"id"\s*:\s*"([^"\\]{1,256})"')
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
    answer_limit: int = 1 << 62
    """Characters of answer text kept at most: the next turn's prompt can use no more."""
    answer_truncated: bool = False
    """The answer ran past `answer_limit`: it is dropped, never recorded in part."""
    malformed: bool = False
    """A non-streamed 200 whose body is not the endpoint's JSON object."""
    answered: bool = False
    """The client was sent the first bytes of a successful answer."""
    relayed_tokens: int = 0
    """Generated tokens in the stream's events: one per choice an event carries a delta of
    (vLLM sends a token an event, more with `--stream-interval`)."""
    _answer_chars: int = field(default=0, init=False, repr=False)

    @property
    def answer(self) -> str:
        """The whole answer; empty when there was none or it was too long to keep."""
        return "" if self.answer_truncated else "".join(self.answer_parts)

    def add_answer(self, text: str) -> None:
        if self.answer_truncated:
            return
        self._answer_chars += len(text)
        if self._answer_chars > self.answer_limit:
            self.answer_truncated = True
            self.answer_parts.clear()
            return
        parts = self.answer_parts
        parts.append(text)
        if len(parts) > _JOINED_EVERY:
            # A list of one-character deltas costs ~60 bytes a character; one string, one.
            parts[:] = ["".join(parts)]

    def take_usage(self, usage: Any) -> None:
        """Chat's usage (`prompt_tokens`...), the Responses API's (`input_tokens`...) or the
        Messages API's, whose `input_tokens` leave out the tokens read from the cache and
        written to it."""
        if not isinstance(usage, dict):
            return
        prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
        read = usage.get("cache_read_input_tokens")
        if isinstance(prompt, int):
            written = usage.get("cache_creation_input_tokens")
            for counted in (read, written):
                prompt += counted if isinstance(counted, int) else 0
            self.prompt_tokens = prompt
        if isinstance(read, int):
            self.cached_tokens = read
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
                        self.add_answer(part["text"])
                return


def observe_body(body: bytes, answer_limit: int = 1 << 62) -> Observation:
    """Usage and the first choice's text from a non-streamed response (`malformed` when it is
    not a JSON object, as no endpoint's answer is)."""
    seen = Observation(answer_limit=answer_limit)
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        seen.malformed = True
        return seen
    if not isinstance(payload, dict):
        seen.malformed = True
        return seen
    if payload.get("object") == "response":
        seen.take_response(payload)
        return seen
    if payload.get("type") == "message":
        seen.take_usage(payload.get("usage"))
        for part in answer_parts(payload.get("content")):
            seen.add_answer(part)
        return seen
    seen.take_usage(payload.get("usage"))
    choices = payload.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        message = choices[0].get("message")
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            seen.add_answer(message["content"])
    return seen


class StreamObserver:
    """Follows SSE events across chunk boundaries. `feed` returns what the client is to get:
    each chunk as it came, or with `strip_usage` the complete events less the usage-only one."""

    def __init__(
        self, strip_usage: bool = False, answer_limit: int = 1 << 62, count_tokens: bool = False
    ) -> None:
        """`count_tokens`: count the generated tokens relayed (`Observation.relayed_tokens`),
        which only a tenant's charge or the fair queue reads."""
        self.seen = Observation(answer_limit=answer_limit)
        self._strip_usage = strip_usage
        self._count_tokens = count_tokens
        self._pending = b""
        self._messages: MessageEvents | None = None

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
            if isinstance(kind, str):
                if self._count_tokens and (
                    kind == "content_block_delta"
                    or (kind.startswith("response.") and kind.endswith(".delta"))
                ):
                    self.seen.relayed_tokens += 1  # generated text, in Messages or Responses
                if kind.startswith("response."):
                    self._response_event(kind, message)
                    continue
                if kind in MESSAGE_EVENTS:
                    if self._messages is None:
                        self._messages = MessageEvents()
                    self._messages.take(kind, message, self.seen)
                    continue
            choices = message.get("choices")
            if message.get("usage"):
                self.seen.take_usage(message["usage"])
                # OpenAI's usage chunk has `choices: []`; some servers leave the key out.
                usage_only = choices is None or choices == []
            if self._count_tokens and isinstance(choices, list):
                self.seen.relayed_tokens += sum(map(_generated, choices))
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
                        self.seen.add_answer(content)
        return usage_only

    def _response_event(self, kind: str, message: dict[str, Any]) -> None:
        """One of the Responses API's typed events."""
        seen = self.seen
        if kind == "response.output_text.delta":
            if isinstance(message.get("delta"), str):
                seen.add_answer(message["delta"])
        elif kind == "response.created":
            response = message.get("response")
            if isinstance(response, dict) and isinstance(response.get("id"), str):
                seen.response_id = response["id"]
        elif kind in _RESPONSE_ENDS:
            response = message.get("response")
            if isinstance(response, dict):
                seen.take_usage(response.get("usage"))
            seen.complete = True


def _generated(choice: object) -> bool:
    """Whether a streamed choice carries generated text: a chat delta's content, reasoning or
    tool call, or a completion's text."""
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return bool(
            delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")
        )
    return bool(choice.get("text"))


_RESPONSE_ENDS = frozenset({"response.completed", "response.incomplete", "response.failed"})


def opening_id(opening: bytes) -> str | None:
    """The `id` a JSON object opens with (a Responses API response's comes first), if any."""
    found = _OPENING_ID.match(opening)
    return None if found is None else found.group(1).decode("utf-8", "replace")


def usage_in_tail(tail: bytes) -> Any:
    """The last `"usage"` object in the tail of a JSON body (OpenAI and vLLM put it at the
    end), parsed; None when the tail holds no whole one."""
    at = len(tail)
    while (at := tail.rfind(b'"usage"', 0, at)) > 0 and tail[at - 1] == 0x5C:
        pass  # `\"usage\"` inside a string: look further back
    if at < 0:
        return None
    start = tail.find(b"{", at)
    if start < 0 or tail[at + 7 : start].strip() != b":":
        return None
    end = _object_end(tail, start)
    if end is None:
        return None
    try:
        return orjson.loads(tail[start:end])
    except orjson.JSONDecodeError:
        return None


def _object_end(data: bytes, start: int) -> int | None:
    """Where the JSON object opening at `start` ends (past its `}`), strings skipped."""
    depth = 0
    in_string = escaped = False
    for index in range(start, min(len(data), start + 4096)):
        byte = data[index]
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:
                escaped = True
            elif byte == 0x22:
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte == 0x7B:
            depth += 1
        elif byte == 0x7D:
            depth -= 1
            if depth == 0:
                return index + 1
    return None
