"""One format for every line the gateway writes (`--log-format json|text`, docs/observability.md):
the package's records and uvicorn's on standard error, the access log on standard output.

`json`: one object a line, `{"ts", "level", "logger", "message"}` and `exc_info` with a
traceback, so that a record and its traceback stay one line for a log collector. `text`:
`2026-12-02 14:00:00,123 INFO prefix_gateway.server: message`, tracebacks on the lines after.
"""

from __future__ import annotations

import logging
import sys
import threading
from types import TracebackType
from typing import Any

import orjson

LOG_FORMATS = ("json", "text")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# uvicorn's loggers: left without handlers of their own, their records reach the root's.
_UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack_info"] = self.formatStack(record.stack_info)
        return orjson.dumps(line).decode()


def formatter(log_format: str) -> logging.Formatter:
    return JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)


def configure_logging(level: str, log_format: str) -> None:
    """The root logger writes `log_format` to standard error; uvicorn's loggers, Python's
    warnings and exceptions nothing caught go through it (uvicorn is given no logging
    configuration of its own)."""
    handler = logging.StreamHandler()
    handler.setFormatter(formatter(log_format))
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in _UVICORN_LOGGERS:
        logger = logging.getLogger(name)
        for old in logger.handlers[:]:
            logger.removeHandler(old)
        logger.propagate = True
    logging.captureWarnings(True)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    sys.excepthook = _log_uncaught
    threading.excepthook = _log_uncaught_in_thread


def _log_uncaught(
    kind: type[BaseException], value: BaseException, traceback: TracebackType | None
) -> None:
    """An exception nothing caught, as a record in the log's format rather than Python's
    plain traceback."""
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, value, traceback)
        return
    logging.getLogger("prefix_gateway").critical(
        "uncaught exception", exc_info=(kind, value, traceback)
    )


def _log_uncaught_in_thread(hook: threading.ExceptHookArgs) -> None:
    if issubclass(hook.exc_type, SystemExit):  # as threading's own hook: a thread's exit
        return
    value = hook.exc_value if hook.exc_value is not None else hook.exc_type()
    _log_uncaught(hook.exc_type, value, hook.exc_traceback)
