"""How the lean upstream client reads responses from raw TCP servers: interim answers, bodies
that end with the connection, and heads past their limits."""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest

from prefix_gateway.proxy.http1 import ConnectionPool, HTTPClientError
from tests.test_http1 import answer, read_request, serve


@pytest.mark.parametrize("together", [False, True], ids=["apart", "in one packet"])
def test_interim_responses_are_skipped_and_the_next_request_gets_its_own_answer(
    together: bool,
) -> None:
    connections: list[int] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        await read_request(reader)
        parts = [
            b"HTTP/1.1 103 Early Hints\r\nlink: </a.css>; rel=preload\r\n\r\n",
            b"HTTP/1.1 100 Continue\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nx-answer: final\r\ncontent-length: 5\r\n\r\nfirst",
        ]
        for part in [b"".join(parts)] if together else parts:
            writer.write(part)
            await writer.drain()
        await read_request(reader)
        writer.write(answer(b"second"))
        await writer.drain()

    async def scenario(url: str) -> None:
        pool = ConnectionPool(2)
        response = await pool.post(url, [], b"{}")
        assert response.status == 200
        assert response.raw_headers == [(b"x-answer", b"final"), (b"content-length", b"5")]
        assert await response.read() == b"first"
        response.release()
        response = await pool.post(url, [], b"{}")
        assert (response.status, await response.read()) == (200, b"second")
        response.release()
        assert connections == [1]
        pool.close()

    serve(handler, scenario)


def test_a_switch_of_protocols_is_a_broken_response() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\nconnection: upgrade\r\n\r\n"
        )
        await writer.drain()

    async def scenario(url: str) -> None:
        pool = ConnectionPool(2)
        with pytest.raises(HTTPClientError) as caught:
            await pool.post(url, [], b"{}")
        assert caught.value.cause == "protocol"
        pool.close()

    serve(handler, scenario)


@pytest.mark.parametrize("version", [b"1.1", b"1.0"])
def test_a_body_without_length_ends_with_the_connection(version: bytes) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/%s 200 OK\r\ncontent-type: text/event-stream\r\n\r\n" % version)
        for event in (b"data: 1\n\n", b"data: 2\n\n"):
            writer.write(event)
            await writer.drain()
        writer.close()

    async def scenario(url: str) -> None:
        pool = ConnectionPool(2)
        response = await pool.post(url, [], b"{}")
        assert not response.keep_alive
        chunks = []
        while chunk := await response.readany():
            chunks.append(chunk)
        assert b"".join(chunks) == b"data: 1\n\ndata: 2\n\n"
        response.release()
        assert not any(pool._idle.values())  # ended by the close: not reused
        pool.close()

    serve(handler, scenario)


def test_a_body_without_length_that_is_reset_is_broken() -> None:
    head_read = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n\r\npartial")
        await writer.drain()
        await head_read.wait()
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # a reset, not an end

    async def scenario(url: str) -> None:
        pool = ConnectionPool(2)
        response = await pool.post(url, [], b"{}")
        head_read.set()
        with pytest.raises(HTTPClientError) as caught:
            await response.read()
        assert caught.value.cause == "closed"
        response.release()
        pool.close()

    serve(handler, scenario)


def header_lines(count: int, size: int) -> bytes:
    """`count` headers of `size` bytes each, their CRLF included."""
    return b"".join(b"x-%05d: %s\r\n" % (index, b"v" * (size - 11)) for index in range(count))


@pytest.mark.parametrize(
    ("head", "in_pieces", "limits", "fits"),
    [
        (header_lines(60, 1024), False, {}, True),
        (header_lines(70, 1024), True, {}, False),  # fails before the head is complete
        (header_lines(70, 1024), False, {}, False),
        (header_lines(2, 1024), False, {"max_head_bytes": 1024}, False),
        (header_lines(99, 16), False, {}, True),  # and content-length: 100
        (header_lines(100, 16), False, {}, False),
        (header_lines(11, 16), False, {"max_headers": 10}, False),
    ],
    ids=["60 KiB", "70 KiB in pieces", "70 KiB", "2 KiB past 1 KiB", "100", "101", "12 past 10"],
)
def test_a_response_head_past_its_limits_fails_and_closes_the_connection(
    head: bytes, in_pieces: bool, limits: dict[str, int], fits: bool
) -> None:
    client_left = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        data = b"HTTP/1.1 200 OK\r\n" + head + b"content-length: 2\r\n\r\nok"
        pieces = [data[start : start + 1024] for start in range(0, len(data), 1024)]
        for piece in pieces if in_pieces else [data]:
            writer.write(piece)
            await writer.drain()
        if not fits:
            assert await reader.read() == b""
            client_left.set()

    async def scenario(url: str) -> None:
        pool = ConnectionPool(2, **limits)  # type: ignore[arg-type]
        if fits:
            response = await pool.post(url, [], b"{}")
            assert len(response.raw_headers) == head.count(b"\r\n") + 1
            assert await response.read() == b"ok"
            response.release()
            pool.close()
            return
        with pytest.raises(HTTPClientError) as caught:
            await pool.post(url, [], b"{}")
        assert caught.value.cause == "protocol"
        await client_left.wait()
        assert not any(pool._idle.values())
        pool.close()

    serve(handler, scenario)
