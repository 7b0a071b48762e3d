"""A server in a child process on a loopback port, started, checked healthy and stopped: for
`serve --emulate N`, tests and benchmarks.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Sequence
from types import TracebackType
from typing import IO, Self

import httpx
from prometheus_client.parser import text_string_to_metric_families

from prefix_gateway import logwatch
from prefix_gateway.logwatch import GATEWAY_LOG, REPORTED_CHARACTERS, TRACEBACK, LogWatch, read_log


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


def start_together(processes: Sequence[ChildProcess]) -> None:
    """Start every process, then wait for each: their start-ups overlap. One that did not
    start is started again alone; if any cannot be, all are stopped and the error raised."""
    try:
        for process in processes:
            process.spawn()
        for process in processes:
            if not process.wait_started():
                process.start()
    except BaseException:
        for process in processes:
            process.stop()
        raise


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


class ChildProcess:
    """`python -m MODULE ARGS --host H --port P`, healthy once `GET health_path` answers 200."""

    health_path = "/health"

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
        self._watch = LogWatch(GATEWAY_LOG)
        self._port_chosen = False
        """Whether `spawn` chose the port (and gives it up if the start fails)."""

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
            self.spawn()
            if self.wait_started():
                return self
        raise RuntimeError(f"{self.module} did not start: {self.log()[-2000:]}")

    def spawn(self) -> None:
        """Start the process (on a free port unless one was given) without waiting for it."""
        self._port_chosen = self.port == 0
        if self._port_chosen:
            self.port = free_port(self.host)
        self._spawn()

    def wait_started(self) -> bool:
        """Wait until healthy; stopped (its chosen port given up) if it did not become so."""
        if self._wait_healthy():
            return True
        self.stop()
        if self._port_chosen:
            self.port = 0
        return False

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
        logwatch.ended(self)
        return process.returncode

    def kill(self) -> None:
        """Die at once, as a crashed process would."""
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None
            logwatch.ended(self)

    @property
    def label(self) -> str:
        """The process as a failure report names it: its module and arguments."""
        return f"{self.module} {' '.join(self.args)}"

    def log(self) -> str:
        return "" if self._log is None else read_log(self._log).decode(errors="replace")

    def tracebacks(self) -> list[str]:
        """Every traceback the process logged, each from its first line to the log's end or
        the next traceback: a witness of an error nobody was answered about."""
        parts = self.log().split(TRACEBACK)[1:]
        return [TRACEBACK + part[:REPORTED_CHARACTERS] for part in parts]

    def expect_log(self, pattern: str) -> Self:
        """Allow error records in which the regular expression `pattern` is found: an error the
        test provokes on purpose. Every other one is unexpected."""
        self._watch.expect(pattern)
        return self

    def unexpected_errors(self) -> list[str]:
        """The error records logged since the last call that no `expect_log` pattern allows."""
        return [] if self._log is None else self._watch.errors(self._log)

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
        if output is not None:
            logwatch.started(self)

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
