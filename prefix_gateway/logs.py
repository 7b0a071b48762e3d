"""One format for every line the gateway writes (`--log-format json|text`, docs/observability.md):
the package's records and uvicorn's on standard error, the access log on standard output.

`json`: one object a line, `{"ts", "level", "logger", "message"}` and `exc_info` with a
traceback, so that a record and its traceback stay one line for a log collector. `text`:
`2026-12-02 14:00:00,123 INFO prefix_gateway.server: message`, tracebacks on the lines after.
"""

from __future__ import annotations

import logging
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
    """The root logger writes `log_format` to standard error; uvicorn's loggers and Python's
    warnings go through it (uvicorn is given no logging configuration of its own)."""
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
