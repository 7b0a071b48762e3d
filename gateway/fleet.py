"""Emulated replicas as real processes: for `serve --emulate N`, tests and benchmarks."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def wait_healthy(
    url: str, timeout: float = 20.0, process: subprocess.Popen[bytes] | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"process for {url} exited with {process.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not become healthy within {timeout} s")


def stop_process(process: subprocess.Popen[bytes], grace: float = 5.0) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class EmulatedReplica:
    name: str
    host: str
    port: int
    args: tuple[str, ...]
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        command = [
            sys.executable,
            "-m",
            "gateway.emulator",
            "--host",
            self.host,
            "--port",
            str(self.port),
            *self.args,
        ]
        self.process = subprocess.Popen(command, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)


class EmulatedFleet:
    """`count` emulated replicas of one model on free loopback ports."""

    def __init__(
        self,
        count: int,
        model: str = "emulated-model",
        args: Sequence[str] = (),
        host: str = "127.0.0.1",
    ) -> None:
        self.replicas = [
            EmulatedReplica(
                f"replica-{position}",
                host,
                free_port(host),
                ("--name", model, "--seed", str(position), *args),
            )
            for position in range(count)
        ]

    @property
    def urls(self) -> list[str]:
        return [replica.url for replica in self.replicas]

    def start(self) -> EmulatedFleet:
        try:
            for replica in self.replicas:
                replica.start()
            for replica in self.replicas:
                wait_healthy(replica.url, process=replica.process)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for replica in self.replicas:
            replica.stop()

    def __enter__(self) -> EmulatedFleet:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop()
