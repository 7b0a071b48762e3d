"""Real redis-server processes on free loopback ports for tests and benchmarks.

Never the shared server on 6379: every test starts its own, without persistence, and stops it.

    with RedisServer() as server:
        client = redis.asyncio.Redis.from_url(server.url)
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Self

from prefix_gateway import logwatch
from prefix_gateway.clock import Clock
from prefix_gateway.logwatch import REDIS_LOG, LogWatch
from prefix_gateway.processes import free_port
from prefix_gateway.state.index import PrefixIndex
from prefix_gateway.state.redis import KeySpace, RedisPrefixIndex, RedisSessionStore, open_client
from prefix_gateway.state.redis.connection import RedisClient
from prefix_gateway.state.sessions import SessionStore

# Gateway flags for tests about sharing, not deadlines (test_redis_store.py checks those): a
# deadline well above loopback latency keeps a busy test machine from turning lookups into
# fallbacks.
PATIENT = ("--redis-timeout", "0.5")

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"


def ping(port: int, host: str = "127.0.0.1", timeout: float = 0.5) -> bool:
    """True when a server on `port` answers PING (and has finished loading)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as connection:
            connection.sendall(b"PING\r\n")
            return connection.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """`redis-server --port P --save '' --appendonly no`; `kill` and `start` keep the port."""

    def __init__(self, *extra: str, port: int = 0, startup_seconds: float = 30.0) -> None:
        self.port = port or free_port()
        self.extra = tuple(extra)
        self._startup_seconds = startup_seconds
        self._process: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="redis-test-")
        self._watch = LogWatch(REDIS_LOG)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> Self:
        command = [
            REDIS_SERVER,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self._dir.name,
            "--logfile",
            self._log_path,
            *self.extra,
        ]
        self._process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        logwatch.started(self)
        deadline = time.monotonic() + self._startup_seconds
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"redis-server exited: {self.log()[-2000:]}")
            if ping(self.port):
                return self
            time.sleep(0.01)
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING")

    @property
    def _log_path(self) -> str:
        return os.path.join(self._dir.name, "redis.log")

    def log(self) -> str:
        try:
            with open(self._log_path, encoding="utf-8", errors="replace") as handle:
                return handle.read()
        except OSError:
            return ""

    @property
    def label(self) -> str:
        """The server as a failure report names it."""
        return f"redis-server {self.address}"

    def unexpected_errors(self) -> list[str]:
        """What the server logged since the last call that says it failed (a crash report)."""
        try:
            with open(self._log_path, "rb") as log:
                return self._watch.errors(log)
        except FileNotFoundError:
            return []

    def kill(self) -> None:
        """Die at once, as a crashed server would; everything it held is lost."""
        process, self._process = self._process, None
        if process is not None:
            process.kill()
            process.wait()
            logwatch.ended(self)

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if process is not None:
            logwatch.ended(self)

    def cli(self, *args: str) -> str:
        result = subprocess.run(
            [REDIS_CLI, "-p", str(self.port), *args],
            capture_output=True,
            check=True,
            timeout=10,
        )
        return result.stdout.decode()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop()
        self._dir.cleanup()


class RedisClusterServers:
    """Three masters with `--cluster-enabled yes`, joined by `redis-cli --cluster create`."""

    def __init__(self, nodes: int = 3) -> None:
        # The bus port is given: the default, port + 10000, may be taken or past 65535.
        self.nodes = [
            RedisServer(
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "2000",
                "--cluster-port",
                str(free_port()),
            )
            for _ in range(nodes)
        ]

    @property
    def url(self) -> str:
        """The gateway's spelling of a cluster: any node as the seed."""
        return f"redis+cluster://{self.nodes[0].address}"

    def start(self) -> Self:
        try:
            for node in self.nodes:
                node.start()
            addresses: Sequence[str] = [node.address for node in self.nodes]
            subprocess.run(
                [
                    REDIS_CLI,
                    "--cluster",
                    "create",
                    *addresses,
                    "--cluster-replicas",
                    "0",
                    "--cluster-yes",
                ],
                capture_output=True,
                check=True,
                timeout=30,
            )
            self._wait_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ok(self, seconds: float = 20.0) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if all("cluster_state:ok" in node.cli("cluster", "info") for node in self.nodes):
                return
            time.sleep(0.05)
        raise RuntimeError("the Redis cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        for node in self.nodes:
            node.__exit__(kind, error, trace)


_opened: list[RedisClient] = []


def _client(url: str) -> RedisClient:
    client = open_client(url, timeout=1.0, max_connections=4)
    _opened.append(client)
    return client


async def close_opened_clients() -> None:
    """Close the clients the factories below opened, on the event loop that used them."""
    while _opened:
        await _opened.pop().aclose()


def redis_index_factory(url: str) -> Callable[[Clock, float, int], PrefixIndex]:
    """A fresh RedisPrefixIndex per call, in a namespace of its own (the size is Redis's)."""

    def build(clock: Clock, ttl: float, size: int) -> PrefixIndex:
        keys = KeySpace(f"test-{uuid.uuid4().hex[:8]}")
        return RedisPrefixIndex(_client(url), keys, ttl, clock)

    return build


def redis_session_factory(url: str) -> Callable[[Clock, float, int], SessionStore]:
    def build(clock: Clock, ttl: float, size: int) -> SessionStore:
        keys = KeySpace(f"test-{uuid.uuid4().hex[:8]}")
        return RedisSessionStore(_client(url), keys, ttl, clock)

    return build
