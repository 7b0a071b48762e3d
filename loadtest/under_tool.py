"""A gateway started under a measuring tool (a profiler, valgrind) in front of one replica:
started from a checkout, waited for until healthy, stopped with SIGTERM so that the tool
writes what it measured."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

from prefix_gateway.processes import free_port


@contextmanager
def gateway_under(
    python: Sequence[str],
    checkout: Path,
    replica: str,
    *gateway_args: str,
    env: dict[str, str] | None = None,
    patience: float = 120.0,
) -> Iterator[str]:
    """The URL of a gateway run as `python` + `-m prefix_gateway serve`, where `python` is the
    command that stands for the interpreter (a tool's, with the interpreter or in its place),
    healthy within `patience` seconds (a tool slows its start-up down)."""
    port = free_port()
    command = [
        *python,
        *("-m", "prefix_gateway", "serve"),
        *("--backend", replica, "--port", str(port), "--health-interval", "3600"),
        *("--log-level", "warning", *gateway_args),
    ]
    # No doctor's checks: their work would count as the requests'.
    environment = {**os.environ, "GATEWAY_DOCTOR_INTERVAL": "0", **(env or {})}
    process = subprocess.Popen(
        command, cwd=checkout, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + patience
        while not _healthy(url):
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError(f"the gateway of {checkout} did not start under {python[0]}")
            time.sleep(0.3)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(patience)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False
