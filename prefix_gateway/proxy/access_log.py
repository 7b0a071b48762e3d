"""The access log: one line per request on the logger `prefix_gateway.access`, with what an
operator needs to follow a request (docs/observability.md) and never the prompt: a JSON object,
or with `--log-format text` a record whose message is `key=value` pairs. The line is built only
when the logger is enabled for INFO.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, BinaryIO, TextIO

import orjson

from prefix_gateway.config import Settings
from prefix_gateway.logs import formatter
from prefix_gateway.routing.placement import Placement
from prefix_gateway.routing.types import Outcome

LOGGER = "prefix_gateway.access"


class JsonLinesHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The default handler: each message a line on a stream. With a binary buffer (stdout),
    `AccessLog` hands it whole lines, with no record per line, and the handler gathers them:
    they are written together when `_WRITE_AT` bytes wait, on the server's tick
    (`flush_access_log`, a tenth of a second apart) and at exit. Under `PYTHONUNBUFFERED`
    (containers set it) stdout's buffer would otherwise cost a system call per request."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__(stream)
        self.setFormatter(logging.Formatter("%(message)s"))
        self.binary: BinaryIO | None = getattr(stream, "buffer", None)
        self._waiting = bytearray()

    def write_line(self, line: bytes) -> None:
        waiting = self._waiting
        waiting += line
        waiting += b"\n"
        if len(waiting) >= _WRITE_AT:
            self.flush()

    def emit(self, record: logging.LogRecord) -> None:
        self.flush()  # lines gathered before the record go out before it
        super().emit(record)

    def flush(self) -> None:
        self.acquire()
        try:
            if self.binary is not None:
                if self._waiting:
                    self.binary.write(self._waiting)
                    self._waiting.clear()
                self.binary.flush()
        finally:
            self.release()
        super().flush()


_WRITE_AT = 64 * 1024
"""Bytes of gathered lines that are written at once, without waiting for the tick."""


def configure_access_logger(log_format: str = "json", stream: TextIO | None = None) -> None:
    """Lines on stdout whatever the log level, unless already configured: JSON lines, or text
    records as the other loggers write them."""
    logger = logging.getLogger(LOGGER)
    if logger.handlers:
        return
    if log_format == "json":
        logger.addHandler(JsonLinesHandler(stream or sys.stdout))
    else:
        handler = logging.StreamHandler(stream or sys.stdout)
        handler.setFormatter(formatter(log_format))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def flush_access_log() -> None:
    for handler in logging.getLogger(LOGGER).handlers:
        handler.flush()


class AccessLog:
    def __init__(self, settings: Settings) -> None:
        self._logger = logging.getLogger(LOGGER)
        self._enabled = settings.access_log
        self._block_tokens = settings.block_tokens
        self._chars_per_token = settings.chars_per_token
        self._text = settings.log_format == "text"

    def answered(
        self,
        placement: Placement,
        outcome: Outcome,
        request_id: str,
        began: float,
        tenant: str | None = None,
    ) -> None:
        """A request a replica answered; `tenant`: its tenant's name where tenants are named
        (or flow control is on), else left out."""
        if not (self._enabled and self._logger.isEnabledFor(logging.INFO)):
            return
        request = placement.request
        decision = outcome.decision
        first_byte = outcome.first_byte_at
        fields = {
            "request_id": request_id,
            "endpoint": request.endpoint.value,
            "model": request.model,
            "backend": decision.backend,
            "route": decision.route.value,
            "status": outcome.status,
            "stream": request.stream,
            "attempts": len(outcome.tried),
            "prompt_tokens_estimated": round(request.estimated_tokens(self._chars_per_token)),
            "matched_tokens_estimated": decision.matched_blocks * self._block_tokens,
            "prompt_tokens": outcome.prompt_tokens,
            "cached_tokens": outcome.cached_tokens,
            "affinity": placement.affinity(decision.backend),
            "cache_break": placement.cache_break,
            "ttft_s": round(first_byte - began, 6) if first_byte else None,
            "duration_s": round(time.perf_counter() - began, 6),
        }
        if tenant is not None:
            fields["tenant"] = tenant
        self._write(fields)

    def rejected(
        self, request_id: str, path: str, status: int, code: str, tenant: str | None = None
    ) -> None:
        """A request no replica answered: refused, failed or left before it was sent."""
        if not (self._enabled and self._logger.isEnabledFor(logging.INFO)):
            return
        fields: dict[str, Any] = {
            "request_id": request_id,
            "endpoint": path,
            "status": status,
            "error": code,
        }
        if tenant is not None:
            fields["tenant"] = tenant
        self._write(fields)

    def _write(self, fields: dict[str, Any]) -> None:
        logger = self._logger
        if self._text:
            message = " ".join(f"{key}={_text_value(value)}" for key, value in fields.items())
        else:
            # The keys every JSON log record starts with (prefix_gateway.logs).
            line = {"ts": round(time.time(), 3), "level": "INFO", "logger": LOGGER, **fields}
            handlers = logger.handlers
            if len(handlers) == 1 and not logger.filters:
                handler = handlers[0]
                if isinstance(handler, JsonLinesHandler) and handler.binary is not None:
                    handler.write_line(orjson.dumps(line))
                    return
            message = orjson.dumps(line).decode()
        # A record made directly skips the logger's costly look-up of its caller's frame: the
        # line's origin is always here.
        logger.handle(logger.makeRecord(LOGGER, logging.INFO, __file__, 0, message, (), None))


def _text_value(value: object) -> str:
    """A value of a `key=value` pair: JSON's spelling, strings bare unless they need quotes."""
    if isinstance(value, str) and value.isprintable() and not any(c in value for c in ' "=\\'):
        return value
    return orjson.dumps(value).decode()
