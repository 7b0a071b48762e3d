"""Real processes for integration tests: the gateway on a free loopback port."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from types import TracebackType

import httpx

from gateway.fleet import free_port, stop_process, wait_healthy


class GatewayProcess:
    def __init__(self, backends: Sequence[str], *args: str, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [
            sys.executable,
            "-m",
            "gateway",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--health-interval",
            "0.5",
            "--log-level",
            "warning",
            *(part for backend in backends for part in ("--backend", backend)),
            *args,
        ]
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> GatewayProcess:
        self.process = subprocess.Popen(self.command, env=self.env)
        try:
            wait_healthy(self.url, process=self.process)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=5).text

    def __enter__(self) -> GatewayProcess:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop()


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        if series.split("{")[0] != name:
            continue
        if all(f'{key}="{wanted}"' in series for key, wanted in labels.items()):
            total += float(value)
    return total
