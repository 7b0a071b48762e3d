"""The slow-reader attack (a row of loadtest/attacks.py): clients that ask for long streams
with a small receive buffer and never read. The gateway stops reading their replicas
(backpressure); it must not take that for a stalled replica, and ends each stream once its
client has taken nothing for `--client-write-timeout`.
"""

from __future__ import annotations

import asyncio
import http.client
import socket
import time

import orjson

from prefix_gateway.processes import metric_value

MODEL = "emulated-model"
MAX_TOKENS = 40_000
"""About 7 MB of events: past what the kernel buffers for one socket on loopback (4 MiB)."""


def blocked_reader(host: str, port: int, turn: int, max_tokens: int = MAX_TOKENS) -> socket.socket:
    """A client that asks for a long stream with a small receive buffer and never reads."""
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.connect((host, port))
    body = orjson.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"a long story, reader {turn}"}],
            "max_tokens": max_tokens,
            "stream": True,
        }
    )
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    client.sendall(head.encode() + body)
    return client


def _metric(host: str, port: int, name: str) -> float:
    connection = http.client.HTTPConnection(host, port, timeout=30)
    try:
        connection.request("GET", "/metrics")
        return metric_value(connection.getresponse().read().decode(), name)
    finally:
        connection.close()


def _ended(reader: socket.socket) -> str:
    """How the gateway ended the stream, read once it is over: `reset` or `closed`."""
    reader.settimeout(30)
    try:
        while reader.recv(65536):
            pass
    except ConnectionResetError:
        return "reset"
    except TimeoutError:
        return "open"
    finally:
        reader.close()
    return "closed"


def run(host: str, port: int, clients: int = 6, patience: float = 120.0) -> str:
    """What the gateway did about `clients` slow readers, in words."""
    began = time.monotonic()
    readers = [blocked_reader(host, port, turn) for turn in range(clients)]
    while _metric(host, port, "gateway_client_disconnects_total") < clients:
        if time.monotonic() - began > patience:
            break
        time.sleep(0.5)
    took = time.monotonic() - began
    stalls = _metric(host, port, "gateway_backend_stalls_total")
    ends = [_ended(reader) for reader in readers]
    told = ", ".join(f"{how} ×{ends.count(how)}" for how in sorted(set(ends)))
    return f"streams ended after {took:.0f} s ({told}); replicas taken for stalled ×{stalls:.0f}"


async def slow_readers(host: str, port: int) -> str:
    return await asyncio.to_thread(run, host, port)
