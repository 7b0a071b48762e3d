"""Real processes for integration tests: the gateway on a free loopback port."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import httpx

from prefix_gateway.processes import ChildProcess, free_port, metric_value, start_together

__all__ = [
    "PATIENCE_SECONDS",
    "GatewayProcess",
    "eventually",
    "free_port",
    "metric_value",
    "run_script",
    "stall",
    "start_together",
    "wait_until",
]

ROOT = Path(__file__).resolve().parent.parent
# Long enough for a busy 2-core machine: a condition that holds is met far sooner; one that
# never holds fails with `what` instead of hanging the suite. Requests the tests make wait as
# long (`timeout=PATIENCE_SECONDS`): httpx's default of 5 s is short for such a machine.
PATIENCE_SECONDS = 30.0


def wait_until(
    check: Callable[[], object], what: str, seconds: float = PATIENCE_SECONDS, every: float = 0.05
) -> None:
    """Poll `check()` until it is true; fails saying `what` was awaited after `seconds`."""
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds:g} s: {what}")
        time.sleep(every)


def read_to_close(raw: socket.socket) -> bytes:
    """Everything a server sends on `raw` until it closes the connection."""
    received = b""
    try:
        while chunk := raw.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    return received


def stall(replica: ChildProcess, stalled: bool) -> None:
    """Make an emulated replica hold (or release) every token, as a hung engine would."""
    answer = httpx.post(replica.url + "/emulator/stall", json={"stalled": stalled}, timeout=30)
    assert answer.json() == {"stalled": stalled}


async def eventually(
    check: Callable[[], object], what: str, seconds: float = PATIENCE_SECONDS, every: float = 0.01
) -> None:
    """`wait_until` for a test running on an event loop: the loop runs between polls."""
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds:g} s: {what}")
        await asyncio.sleep(every)


def run_script(script: str, *args: str, timeout: float = 180) -> str:
    """What `python SCRIPT ARGS` prints, run from the checkout; fails the test if it failed."""
    result = subprocess.run(
        [sys.executable, script, *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


class GatewayProcess(ChildProcess):
    def __init__(
        self,
        backends: Sequence[str],
        *args: str,
        env: dict[str, str] | None = None,
        checkout: str | None = None,
        startup_seconds: float = 60.0,
        metrics_port: bool = False,
    ):
        """`metrics_port`: serve /metrics on a free port of its own (`--metrics-port`), chosen
        anew, as the API's port is, at each start."""
        super().__init__(
            "prefix_gateway",
            (
                "serve",
                "--health-interval",
                "0.5",
                "--log-level",
                "warning",
                *(part for backend in backends for part in ("--backend", backend)),
                *args,
            ),
            # The doctor's probes are requests at the replicas: tests that count what a replica
            # served, or fill its cache, turn them on (`--doctor-interval`) only where they look
            # at them. A variable, not a flag: another checkout's gateway may not know it.
            # Tests tell the replica that answered by its address in `x-gateway-backend`,
            # which clients are not told by default (a variable: as above).
            env={
                "GATEWAY_DOCTOR_INTERVAL": "0",
                "GATEWAY_BACKEND_HEADER": "address",
                **(env or {}),
            },
            cwd=checkout,
            startup_seconds=startup_seconds,
        )
        self._given_args = self.args
        self._own_metrics_port = metrics_port
        self.metrics_port = 0

    @property
    def metrics_url(self) -> str:
        """Where /metrics is served: the metrics port, or the API's without one."""
        return f"http://{self.host}:{self.metrics_port}" if self.metrics_port else self.url

    def metrics(self) -> str:
        return self.metrics_text()

    def metrics_text(self) -> str:
        return httpx.get(self.metrics_url + "/metrics", timeout=PATIENCE_SECONDS).text

    def _spawn(self) -> None:
        if self._own_metrics_port:
            self.metrics_port = self.port
            while self.metrics_port == self.port:
                self.metrics_port = free_port(self.host)
            self.args = (*self._given_args, "--metrics-port", str(self.metrics_port))
        super()._spawn()


@contextlib.contextmanager
def gateways_on_redis(
    count: int, backends: Sequence[str], redis_url: str, *args: str
) -> Iterator[list[GatewayProcess]]:
    """`count` gateway processes sharing `redis_url`, started together, once each is on it;
    stopped after (a test may have killed some)."""
    started = [GatewayProcess(backends, "--redis-url", redis_url, *args) for _ in range(count)]
    start_together(started)
    try:
        wait_until(
            lambda: sum(gateway.metric("gateway_redis_up") for gateway in started) == count,
            "every gateway on Redis",
        )
        yield started
    finally:
        for gateway in started:
            gateway.stop()
