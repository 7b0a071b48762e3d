"""Attacks by reply size, for `attacks.py`: a replica that answers every request with one very
large body, made as it is sent (the replica holds none of it), and the requests that ask for it.

- a non-streamed chat answer of 300 MB (with a content-length, usage at its end), for 8 s;
- a non-streamed embeddings answer of 2,048 inputs × 4,096 floats, 96 MiB, chunked (a
  legitimate request of 40 KB asks for it), for 8 s;
- four clients asking for 50 MB answers and reading none of it, for 10 s.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import orjson

from tests.fault_servers import read_request

MODEL = "emulated-model"
MIB = 2**20
CHAT_BYTES = 300 * 1000 * 1000
UNREAD_BYTES = 50 * 1000 * 1000
INPUTS, FLOATS = 2048, 4096
_USAGE = orjson.dumps({"prompt_tokens": 12, "completion_tokens": 34, "total_tokens": 46})
_FILLER = b"a" * MIB
_VECTOR = b"[" + b",".join([b"0.012345678"] * FLOATS) + b"]"  # 12 bytes a float: 96 MiB


def _chat_parts(size: int) -> Iterator[bytes]:
    opening = b'{"id":"chatcmpl-large","object":"chat.completion","model":"' + MODEL.encode()
    opening += b'","choices":[{"index":0,"message":{"role":"assistant","content":"'
    closing = b'"},"finish_reason":"stop"}],"usage":' + _USAGE + b"}"
    left = size - len(opening) - len(closing)
    yield opening
    while left > 0:
        piece = _FILLER[: min(left, MIB)]
        left -= len(piece)
        yield piece
    yield closing


def _embeddings_parts() -> Iterator[bytes]:
    yield b'{"object":"list","data":['
    for index in range(INPUTS):
        separator = b"," if index else b""
        yield separator + b'{"object":"embedding","index":%d,"embedding":' % index + _VECTOR + b"}"
    yield b'],"model":"' + MODEL.encode() + b'","usage":' + _USAGE + b"}"


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while (request := await read_request(reader)) is not None:
            method, path, body = request.method, request.path, request.body
            large = path == "/v1/embeddings" or b'"large"' in body or b'"unread"' in body
            if method == "GET" or not large:
                # Probes, and the watcher's normal requests: answered small.
                small = orjson.dumps({"object": "chat.completion", "choices": [], "usage": {}})
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(small))
                writer.write(small)
            elif path == "/v1/embeddings":
                writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                for part in _embeddings_parts():
                    writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                    await writer.drain()
                writer.write(b"0\r\n\r\n")
            else:
                size = UNREAD_BYTES if b'"unread"' in body else CHAT_BYTES
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
                for part in _chat_parts(size):
                    writer.write(part)
                    await writer.drain()
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


@contextmanager
def large_reply_replica() -> Iterator[str]:
    """A replica on a free loopback port, as the gateway's `--backend MODEL=URL`."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = asyncio.run_coroutine_threadsafe(
        asyncio.start_server(_serve, "127.0.0.1", 0), loop
    ).result(30)
    try:
        yield f"{MODEL}=http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        loop.call_soon_threadsafe(server.close)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)


async def _ask(host: str, port: int, path: bytes, body: bytes, read: bool) -> str:
    """Send one request; read its whole answer (the status and bytes read), or none of it."""
    reader, writer = await asyncio.open_connection(host, port, limit=MIB)
    head = b"POST " + path + b" HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    writer.write(head + b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body)
    await writer.drain()
    if not read:
        # A client that never reads: its receive buffer fills and the gateway must wait.
        writer.transport.set_write_buffer_limits(0)
        await asyncio.sleep(10)
        writer.transport.abort()
        return "unread"
    status = (await reader.readline()).split(b" ")[1].decode()
    received = 0
    while chunk := await reader.read(MIB):
        received += len(chunk)
    writer.close()
    return f"{status} ({received / MIB:,.0f} MiB)"


def _chat(tag: str) -> bytes:
    return orjson.dumps(
        {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": tag}]}
    )


async def _for_seconds(host: str, port: int, path: bytes, body: bytes, seconds: float) -> str:
    """The same request again and again for `seconds`, each answer read whole: long enough for
    the watcher beside it to poll throughout."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    answers = Counter[str]()
    while loop.time() < end:
        answers[await _ask(host, port, path, body, True)] += 1
    return ", ".join(f"{answer} ×{count}" for answer, count in answers.items())


async def large_chat(host: str, port: int) -> str:
    return await _for_seconds(host, port, b"/v1/chat/completions", _chat("large"), 8)


async def large_embeddings(host: str, port: int) -> str:
    inputs = [f"input number {index}" for index in range(INPUTS)]
    body = orjson.dumps({"model": MODEL, "input": inputs})
    return await _for_seconds(host, port, b"/v1/embeddings", body, 8)


async def unread_replies(host: str, port: int) -> str:
    asks = (_ask(host, port, b"/v1/chat/completions", _chat("unread"), False) for _ in range(4))
    results = await asyncio.gather(*asks)
    return f"{results.count('unread')} × nothing read for 10 s"
