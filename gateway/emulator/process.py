"""An emulated replica in a child process on a free loopback port, for tests and demos.

    with EmulatorProcess("--cache-blocks", "64") as replica:
        httpx.get(replica.base_url + "/health")

Entering starts `python -m gateway.emulator` and waits until /health answers; leaving sends
SIGTERM and, if the child is still there after a grace period, kills it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import IO

import httpx
from prometheus_client.parser import text_string_to_metric_families

_REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


class EmulatorProcess:
    def __init__(
        self,
        *args: str,
        name: str = "emulated-model",
        host: str = "127.0.0.1",
        startup_seconds: float = 15.0,
        stop_seconds: float = 5.0,
    ) -> None:
        self.name = name
        self.host = host
        self.port = 0
        self._args = args
        self._startup_seconds = startup_seconds
        self._stop_seconds = stop_seconds
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        if self._process is None:
            raise RuntimeError("the emulator is not running")
        return self._process.pid

    def __enter__(self) -> EmulatorProcess:
        self.start()
        return self

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

    def start(self) -> None:
        # A free port can be taken between probing and binding: try a few.
        for _ in range(3):
            self.port = free_port(self.host)
            self._spawn()
            if self._wait_healthy():
                return
            self.stop()
        raise RuntimeError(f"the emulator did not start: {self.log()}")

    def stop(self) -> int | None:
        """Stop the child if it runs; returns its exit status (None if none was started)."""
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
        return process.returncode

    def log(self) -> str:
        """What the child wrote to stdout and stderr so far."""
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the scraped samples named `name` that carry `labels`."""
        text = httpx.get(self.base_url + "/metrics", timeout=5).text
        total = 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(
                    sample.labels.get(key) == value for key, value in labels.items()
                ):
                    total += sample.value
        return total

    def _spawn(self) -> None:
        if self._log is None:
            # Kept open across restarts so that a failed start can show every attempt's output.
            self._log = tempfile.TemporaryFile()  # noqa: SIM115
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            part for part in (str(_REPO_ROOT), env.get("PYTHONPATH", "")) if part
        )
        command = [sys.executable, "-m", "gateway.emulator", "--host", self.host]
        command += ["--port", str(self.port), "--name", self.name, *self._args]
        self._process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log, env=env
        )

    def _wait_healthy(self) -> bool:
        deadline = time.monotonic() + self._startup_seconds
        while time.monotonic() < deadline:
            if self._process is None or self._process.poll() is not None:
                return False
            try:
                if httpx.get(self.base_url + "/health", timeout=1).status_code == 200:
                    return True
            except httpx.TransportError:
                pass
            time.sleep(0.02)
        return False
