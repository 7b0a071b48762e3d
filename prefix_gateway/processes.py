"""A server in a child process on a loopback port, started, checked healthy and stopped: for
`serve --emulate N`, tests and benchmarks.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import IO, ClassVar, Self

import httpx
from prometheus_client.parser import text_string_to_metric_families

_TRACEBACK = "Traceback (most recent call last):"
# A log record's first line, as the gateway (`%(asctime)s %(levelname)s ...`) and uvicorn
# (`LEVEL:    ...`) write it; the lines up to the next such line (a traceback) belong to it. A
# JSON line (`--log-format json`, the access log) is a record of its own.
_RECORD = re.compile(r"^(?:\d{4}-\d\d-\d\d [\d:,.]+ )?(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b")
_ASGI_ERROR = "Exception in ASGI application"


def log_records(text: str) -> list[str]:
    """`text` cut into records: each from a record's first line to the next one's."""
    records: list[list[str]] = [[]]
    for line in text.splitlines():
        if (_RECORD.match(line) or line.startswith("{")) and records[-1]:
            records.append([])
        records[-1].append(line)
    return ["\n".join(lines) for lines in records if lines]


def is_error_record(record: str) -> bool:
    """An error nobody was answered about: a traceback, `Exception in ASGI application`, or a
    record logged at ERROR or CRITICAL (in text, or as a JSON line's `level`)."""
    text_level = _RECORD.match(record)
    level = text_level.group(1) if text_level is not None else _json_level(record)
    return _TRACEBACK in record or _ASGI_ERROR in record or level in ("ERROR", "CRITICAL")


def _json_level(record: str) -> str | None:
    if not record.startswith("{"):
        return None
    try:
        line = json.loads(record.split("\n", 1)[0])
    except ValueError:
        return None
    level = line.get("level") if isinstance(line, dict) else None
    return level if isinstance(level, str) else None


def metric_value(text: str, name: str, **labels: str) -> float:
    """The sum of the samples named `name` in Prometheus text `text` that carry `labels`."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(
                sample.labels.get(key) == value for key, value in labels.items()
            ):
                total += sample.value
    return total


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


class ChildProcess:
    """`python -m MODULE ARGS --host H --port P`, healthy once `GET health_path` answers 200."""

    health_path = "/health"
    on_stop: ClassVar[Callable[[ChildProcess], None] | None] = None
    """Called with each process once it has ended (stopped or killed), its log still readable:
    a test suite sets it to check `unexpected_errors()`. Unset, stopping never checks."""

    def __init__(
        self,
        module: str,
        args: Sequence[str] = (),
        host: str = "127.0.0.1",
        port: int = 0,
        env: dict[str, str] | None = None,
        startup_seconds: float = 60.0,
        stop_seconds: float = 5.0,
        capture_output: bool = True,
        cwd: str | None = None,
    ) -> None:
        self.module = module
        self.args = tuple(args)
        self.host = host
        self.port = port
        self.env = env or {}
        self._startup_seconds = startup_seconds
        self._stop_seconds = stop_seconds
        self._capture = capture_output
        self._cwd = cwd
        """Where the module is found first (`python -m` puts the working directory first)."""
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._expected: list[re.Pattern[str]] = []
        self._checked = 0
        """How much of the log `unexpected_errors` has already read."""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        if self._process is None:
            raise RuntimeError("the process is not running")
        return self._process.pid

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> Self:
        """Start and wait until healthy; a port chosen here that was taken meanwhile is retried."""
        fixed = self.port != 0
        for _ in range(1 if fixed else 3):
            if not fixed:
                self.port = free_port(self.host)
            self._spawn()
            if self._wait_healthy():
                return self
            self.stop()
            if not fixed:
                self.port = 0
        raise RuntimeError(f"{self.module} did not start: {self.log()[-2000:]}")

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after the grace period; returns the exit status."""
        process, self._process = self._process, None
        if process is None:
            return None
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(self._stop_seconds)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._ended()
        return process.returncode

    def kill(self) -> None:
        """Die at once, as a crashed process would."""
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None
            self._ended()

    def log(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def tracebacks(self) -> list[str]:
        """Every traceback the process logged, each from its first line to the log's end or
        the next traceback: a witness of an error nobody was answered about."""
        parts = self.log().split(_TRACEBACK)[1:]
        return [_TRACEBACK + part[:4000] for part in parts]

    def expect_log(self, pattern: str) -> Self:
        """Allow error records in which the regular expression `pattern` is found: an error the
        test provokes on purpose. Every other one is unexpected."""
        self._expected.append(re.compile(pattern))
        return self

    def unexpected_errors(self) -> list[str]:
        """The error records (`is_error_record`) logged since the last call that no
        `expect_log` pattern allows."""
        text = self.log()
        fresh, self._checked = text[self._checked :], len(text)
        return [
            record[:4000]
            for record in log_records(fresh)
            if is_error_record(record)
            and not any(pattern.search(record) for pattern in self._expected)
        ]

    def _ended(self) -> None:
        hook = ChildProcess.on_stop
        if hook is not None:
            hook(self)

    def metrics_text(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=5).text

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the scraped samples named `name` that carry `labels`."""
        return metric_value(self.metrics_text(), name, **labels)

    def _spawn(self) -> None:
        output: IO[bytes] | None = None
        if self._capture:
            if self._log is None:
                self._log = tempfile.TemporaryFile()  # noqa: SIM115 - kept across restarts
                # Closed with this object when it is not used as a context manager.
                weakref.finalize(self, self._log.close)
            output = self._log
        command = [sys.executable, "-m", self.module, *self.args]
        command += ["--host", self.host, "--port", str(self.port)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self._process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=output, stderr=output, env=env, cwd=self._cwd
        )

    def _wait_healthy(self) -> bool:
        deadline = time.monotonic() + self._startup_seconds
        while time.monotonic() < deadline:
            if self._process is None or self._process.poll() is not None:
                return False
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.url + self.health_path, timeout=1).status_code == 200:
                    return True
            time.sleep(0.02)
        return False

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
        if self._log is not None:
            self._log.close()
            self._log = None
