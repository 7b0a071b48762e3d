"""The lean upstream client against a real emulated replica and small raw TCP servers."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import orjson
import pytest

from gateway.emulator import EmulatorProcess
from gateway.processes import free_port
from gateway.proxy.http1 import ConnectionPool, HTTPClientError

JSON = [(b"content-type", b"application/json")]


def chat(stream: bool = False) -> bytes:
    return orjson.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "a b c"}],
            "max_tokens": 4,
            "stream": stream,
        }
    )


def test_requests_reuse_one_connection_and_stream_chunks() -> None:
    with EmulatorProcess(name="m") as replica:

        async def scenario() -> None:
            pool = ConnectionPool(connect_timeout=2)
            url = replica.url + "/v1/chat/completions"
            for _ in range(3):
                response = await pool.post(url, JSON, chat())
                assert response.status == 200
                body = orjson.loads(await response.read())
                assert body["usage"]["completion_tokens"] == 4
                response.release()
            assert sum(len(idle) for idle in pool._idle.values()) == 1
            response = await pool.post(url, JSON, chat(stream=True))
            chunks = []
            while chunk := await response.readany():
                chunks.append(chunk)
            response.release()
            assert b"".join(chunks).count(b"data: ") == 5  # 4 tokens, [DONE]
            pool.close()

        asyncio.run(scenario())


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def serve(handler: Handler, scenario: Callable[[str], Awaitable[None]]) -> None:
    async def main() -> None:
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            await scenario(f"http://127.0.0.1:{port}/v1/completions")

    asyncio.run(main())


async def read_request(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    await reader.readexactly(length)


def test_a_kept_alive_connection_closed_by_the_server_is_replaced() -> None:
    async def answer_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()  # but said nothing of closing: the client keeps it

    async def scenario(url: str) -> None:
        pool = ConnectionPool(connect_timeout=2)
        for _ in range(3):
            response = await pool.post(url, [], b"{}")
            assert await response.read() == b"ok"
            response.release()
            await asyncio.sleep(0.05)

    serve(answer_once, scenario)


def test_failures_carry_their_cause() -> None:
    async def refused() -> None:
        pool = ConnectionPool(connect_timeout=2)
        with pytest.raises(HTTPClientError) as caught:
            await pool.post(f"http://127.0.0.1:{free_port()}/x", [], b"")
        assert caught.value.cause == "connect"

    asyncio.run(refused())

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(5)

    async def times_out(url: str) -> None:
        # The caller bounds the wait; the connection is closed, not pooled.
        pool = ConnectionPool(2)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await pool.post(url, [], b"{}")
        assert not any(pool._idle.values())

    serve(silent, times_out)

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()

    async def bad_response(url: str) -> None:
        with pytest.raises(HTTPClientError) as caught:
            await ConnectionPool(2).post(url, [], b"{}")
        assert caught.value.cause == "protocol"

    serve(garbage, bad_response)

    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        await writer.drain()
        writer.close()

    async def cut_mid_body(url: str) -> None:
        response = await ConnectionPool(2).post(url, [], b"{}")
        with pytest.raises(HTTPClientError) as caught:
            await response.read()
        assert caught.value.cause == "closed"

    serve(cut, cut_mid_body)

    async def stalls_mid_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        await asyncio.sleep(5)

    async def idle(url: str) -> None:
        response = await ConnectionPool(2).post(url, [], b"{}")
        seen = []
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                while chunk := await response.readany():
                    seen.append(chunk)
        assert seen == [b"hello"]
        response.release()  # unfinished: closed, not pooled

    serve(stalls_mid_stream, idle)
