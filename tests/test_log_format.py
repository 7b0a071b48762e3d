"""`--log-format json|text`: every line a real gateway writes (its own records, uvicorn's, the
access log; standard output and error), in one process and under `--workers`, is in the format."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from prefix_gateway.config import ConfigError, load_settings
from prefix_gateway.emulator.replicas import EmulatedReplicas
from prefix_gateway.logs import JsonFormatter
from prefix_gateway.logwatch import GATEWAY_LOG
from tests.conftest import MODEL
from tests.support import GatewayProcess, wait_until

_TEXT_LINE = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) ([\w.]+): (.*)$"
)


@pytest.fixture(scope="module")
def replica() -> Iterator[EmulatedReplicas]:
    with EmulatedReplicas(1, MODEL) as started:
        yield started


def run_and_read(replica: EmulatedReplicas, log_format: str, workers: int) -> list[str]:
    """The lines of a gateway's output from its start to its exit, after a plain, a streamed
    and a refused request."""
    gateway = GatewayProcess(
        replica.urls,
        "--log-level",
        "info",
        "--log-format",
        log_format,
        "--workers",
        str(workers),
    )
    with gateway:
        with openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0) as client:
            client.completions.create(model=MODEL, prompt="one line", max_tokens=2)
            for _ in client.completions.create(
                model=MODEL, prompt="a stream", max_tokens=2, stream=True
            ):
                pass
            with pytest.raises(openai.NotFoundError):
                client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
        assert httpx.get(gateway.url + "/health", timeout=5).status_code == 200
        # Every access line is out once the requests are answered (flushed at the latest at
        # exit); the exit's own records come with the stop.
        wait_until(lambda: gateway.log().count("prefix_gateway.access") >= 3, "the access log")
        gateway.stop()
        return gateway.log().splitlines()


def json_records(lines: list[str]) -> list[dict[str, Any]]:
    records = []
    for line in lines:
        record = json.loads(line)  # every line, or this fails
        assert isinstance(record, dict), line
        assert {"ts", "level", "logger"} <= set(record), line
        assert isinstance(record["ts"], float | int) and record["level"] in (
            "DEBUG",
            "INFO",
            "WARNING",
            "ERROR",
            "CRITICAL",
        )
        assert "message" in record or record["logger"] == "prefix_gateway.access", line
        records.append(record)
    return records


def text_records(lines: list[str]) -> list[tuple[str, str, str]]:
    records = []
    for line in lines:
        found = _TEXT_LINE.match(line)
        assert found is not None, f"not a text record: {line!r}"
        level, logger, message = found.groups()
        records.append((level, logger, message))
    return records


@pytest.mark.parametrize("workers", [1, 2])
def test_every_line_is_one_json_object(replica: EmulatedReplicas, workers: int) -> None:
    records = json_records(run_and_read(replica, "json", workers))
    loggers = {record["logger"] for record in records}
    assert {"uvicorn.error", "prefix_gateway.access"} <= loggers
    assert any(name.startswith("prefix_gateway.backends") for name in loggers), loggers
    access = [record for record in records if record["logger"] == "prefix_gateway.access"]
    assert sorted((line["status"], line.get("stream")) for line in access) == [
        (200, False),
        (200, True),
        (404, None),
    ]
    assert any(record.get("message", "").startswith("Started server") for record in records)
    if workers > 1:
        assert "prefix_gateway.workers" in loggers


@pytest.mark.parametrize("workers", [1, 2])
def test_every_line_is_one_text_record(replica: EmulatedReplicas, workers: int) -> None:
    records = text_records(run_and_read(replica, "text", workers))
    loggers = {logger for _, logger, _ in records}
    assert {"uvicorn.error", "prefix_gateway.access"} <= loggers
    assert any(name.startswith("prefix_gateway.backends") for name in loggers), loggers
    access = [message for _, logger, message in records if logger == "prefix_gateway.access"]
    assert len(access) == 3
    assert sum("status=200 stream=true" in line for line in access) == 1
    assert sum("status=404 error=model_not_found" in line for line in access) == 1
    if workers > 1:
        assert "prefix_gateway.workers" in loggers


def test_json_is_the_default_and_an_unknown_format_is_refused() -> None:
    backends = {"GATEWAY_BACKENDS": "http://a:1"}
    assert load_settings(environ=backends).log_format == "json"
    assert load_settings(environ={**backends, "GATEWAY_LOG_FORMAT": "text"}).log_format == "text"
    with pytest.raises(ConfigError, match="log_format must be json or text"):
        load_settings(environ={**backends, "GATEWAY_LOG_FORMAT": "xml"})


def test_a_traceback_stays_inside_its_json_record() -> None:
    caught = None
    try:
        _ = 1 / 0
    except ZeroDivisionError:
        caught = sys.exc_info()
    assert caught is not None
    record = logging.LogRecord(
        "prefix_gateway.proxy", logging.ERROR, __file__, 1, "failed %s", ("here",), caught
    )
    line = JsonFormatter().format(record)
    assert "\n" not in line
    parsed = json.loads(line)
    assert (parsed["level"], parsed["logger"], parsed["message"]) == (
        "ERROR",
        "prefix_gateway.proxy",
        "failed here",
    )
    assert parsed["exc_info"].startswith("Traceback (most recent call last):")
    assert parsed["exc_info"].endswith("ZeroDivisionError: division by zero")
    # The test suite's witness of a started process counts it as an error.
    assert GATEWAY_LOG.is_error(line)
    warning = line.replace('"ERROR"', '"WARNING"').split(',"exc_info"')[0] + "}"
    assert not GATEWAY_LOG.is_error(warning)


@pytest.mark.parametrize("where", ["main", "thread"])
def test_an_exception_nothing_caught_is_a_record_in_the_format(where: str) -> None:
    script = (
        "import threading\n"
        "from prefix_gateway.logs import configure_logging\n"
        "configure_logging('info', 'json')\n"
        "def fail():\n"
        "    raise ValueError('nobody caught this')\n"
        + ("fail()\n" if where == "main" else "t = threading.Thread(target=fail)\nt.start()\n")
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    record = json.loads(lines[0])
    assert (record["level"], record["message"]) == ("CRITICAL", "uncaught exception")
    assert record["exc_info"].endswith("ValueError: nobody caught this")
    assert done.returncode == (1 if where == "main" else 0)
