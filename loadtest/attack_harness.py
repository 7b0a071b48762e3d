"""The harness of loadtest/attacks.py: an attack's description, and the measure of one: a fresh
gateway, a watcher process beside it (`/health`, normal requests, Redis PING), and the
gateway's peak memory growth."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import multiprocessing
import socket
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

import orjson

from tests.redis_server import RedisServer
from tests.support import GatewayProcess

MODEL = "emulated-model"


@dataclass(frozen=True)
class Target:
    host: str
    port: int


@dataclass(frozen=True)
class Attack:
    name: str
    sends: str
    """What the attack sends, in words."""
    run: Callable[[Target], Awaitable[str]] | None
    """Runs the attack; returns what the gateway answered, in words. None: not measured yet."""
    with_redis: bool = False
    """The gateway shares its state through a Redis of its own, whose PING is timed too."""
    replica: Callable[[], contextlib.AbstractContextManager[str]] | None = None
    """The gateway's one backend (a `--backend` spec) in place of the emulated replicas."""


@dataclass(frozen=True)
class Watched:
    """What a watcher saw beside an attack."""

    health_delay_ms: float
    normal_ok: int
    normal_sent: int
    redis_ping_ms: float | None = None


# --- watching the gateway ------------------------------------------------------------------


def _watch(host: str, port: int, stop: Connection, redis_port: int | None) -> None:
    """In its own process: poll /health (and Redis), send a normal request every 0.1 s, until
    told."""
    longest = 0.0
    longest_ping: float | None = None
    normal = Counter[str]()
    done = threading.Event()

    def normal_requests() -> None:
        body = orjson.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        )
        while not done.is_set():
            try:
                connection = http.client.HTTPConnection(host, port, timeout=60)
                connection.request("POST", "/v1/chat/completions", body)
                normal[str(connection.getresponse().status)] += 1
                connection.close()
            except (OSError, http.client.HTTPException):
                normal["error"] += 1
            done.wait(0.1)

    def pings() -> None:
        nonlocal longest_ping
        assert redis_port is not None
        with socket.create_connection(("127.0.0.1", redis_port)) as connection:
            while not done.is_set():
                began = time.perf_counter()
                connection.sendall(b"PING\r\n")
                connection.recv(16)
                longest_ping = max(longest_ping or 0.0, time.perf_counter() - began)
                done.wait(0.01)

    sender = threading.Thread(target=normal_requests)
    sender.start()
    pinger = threading.Thread(target=pings) if redis_port is not None else None
    if pinger is not None:
        pinger.start()
    while not stop.poll(0.02):
        began = time.perf_counter()
        try:
            connection = http.client.HTTPConnection(host, port, timeout=60)
            connection.request("GET", "/health")
            connection.getresponse().read()
            connection.close()
        except (OSError, http.client.HTTPException):
            normal["health_error"] += 1
        longest = max(longest, time.perf_counter() - began)
    done.set()
    sender.join()
    if pinger is not None:
        pinger.join()
    ping_ms = None if longest_ping is None else longest_ping * 1000
    stop.send(Watched(longest * 1000, normal["200"], sum(normal.values()), ping_ms))


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field}")


async def measure(attack: Attack, replicas: list[str]) -> str:
    with contextlib.ExitStack() as stack:
        redis = stack.enter_context(RedisServer()) if attack.with_redis else None
        shared = ("--redis-url", redis.url) if redis is not None else ()
        if attack.replica is not None:
            replicas = [stack.enter_context(attack.replica())]
        gateway = stack.enter_context(GatewayProcess(replicas, "--log-level", "warning", *shared))
        target = Target(gateway.host, gateway.port)
        before = _status_kib(gateway.pid, "VmRSS")
        with open(f"/proc/{gateway.pid}/clear_refs", "w", encoding="ascii") as refs:
            refs.write("5")  # VmHWM starts again from VmRSS
        ours, theirs = multiprocessing.get_context("spawn").Pipe()
        watcher = multiprocessing.get_context("spawn").Process(
            target=_watch,
            args=(gateway.host, gateway.port, theirs, redis.port if redis is not None else None),
        )
        watcher.start()
        if attack.run is None:
            await asyncio.sleep(3)
            answered = "—"
        else:
            answered = await attack.run(target)
        ours.send("stop")
        watched: Watched = ours.recv()
        watcher.join()
        growth = (_status_kib(gateway.pid, "VmHWM") - before) / 1024
    ping = "—" if watched.redis_ping_ms is None else f"{watched.redis_ping_ms:,.0f} ms"
    return (
        f"| {attack.name} | {attack.sends} | {answered} | {growth:,.0f} MiB "
        f"| {watched.health_delay_ms:,.0f} ms | {ping} "
        f"| {watched.normal_ok}/{watched.normal_sent} |"
    )
