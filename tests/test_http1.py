"""The lean upstream client's pool against a real emulated replica and small raw TCP servers:
reuse, connections that went stale while idle, and when a request is sent again."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import orjson
import pytest

from prefix_gateway.emulator.process import EmulatorProcess
from prefix_gateway.processes import free_port
from prefix_gateway.proxy.http1 import ConnectionPool, HTTPClientError

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


@contextlib.asynccontextmanager
async def served(handler: Handler, tls: ssl.SSLContext | None = None) -> AsyncIterator[str]:
    """A raw server on a free loopback port, as its base URL. Its handlers end with it: their
    connections closed, those still running cancelled, all before the event loop closes."""
    running: set[asyncio.Task[object]] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        running.add(task)
        try:
            await handler(reader, writer)
        except (asyncio.CancelledError, ConnectionError, asyncio.IncompleteReadError):
            pass  # the test is over, or the client hung up
        finally:
            writer.close()
            running.discard(task)

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=tls)
    port = server.sockets[0].getsockname()[1]
    try:
        async with server:
            yield f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    finally:
        for task in list(running):
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        await asyncio.sleep(0)  # closed transports let go of their sockets


def serve(handler: Handler, scenario: Callable[[str], Awaitable[None]]) -> None:
    async def main() -> None:
        async with served(handler) as url:
            await scenario(url + "/v1/completions")

    asyncio.run(main())


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """The body of the next request."""
    head = await reader.readuntil(b"\r\n\r\n")
    return await reader.readexactly(content_length(head))


def content_length(head: bytes) -> int:
    return next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )


def answer(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


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
        pool.close()

    serve(answer_once, scenario)


def test_failures_carry_their_cause() -> None:
    async def refused() -> None:
        pool = ConnectionPool(connect_timeout=2)
        with pytest.raises(HTTPClientError) as caught:
            await pool.post(f"http://127.0.0.1:{free_port()}/x", [], b"")
        assert caught.value.cause == "connect"
        pool.close()

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
        pool.close()

    serve(silent, times_out)

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()

    async def bad_response(url: str) -> None:
        pool = ConnectionPool(2)
        with pytest.raises(HTTPClientError) as caught:
            await pool.post(url, [], b"{}")
        assert caught.value.cause == "protocol"
        pool.close()

    serve(garbage, bad_response)

    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        await writer.drain()
        writer.close()

    async def cut_mid_body(url: str) -> None:
        pool = ConnectionPool(2)
        response = await pool.post(url, [], b"{}")
        with pytest.raises(HTTPClientError) as caught:
            await response.read()
        assert caught.value.cause == "closed"
        response.release()
        pool.close()

    serve(cut, cut_mid_body)

    async def stalls_mid_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        await asyncio.sleep(5)

    async def idle(url: str) -> None:
        pool = ConnectionPool(2)
        response = await pool.post(url, [], b"{}")
        seen = []
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                while chunk := await response.readany():
                    seen.append(chunk)
        assert seen == [b"hello"]
        response.release()  # unfinished: closed, not pooled
        assert not any(pool._idle.values())
        pool.close()

    serve(stalls_mid_stream, idle)


def test_an_idle_connection_that_speaks_is_closed_and_not_reused() -> None:
    closed_by_client = asyncio.Event()
    served: list[int] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = len(served)
        served.append(0)
        await read_request(reader)
        served[index] += 1
        writer.write(answer(b"first" if index == 0 else b"second"))
        if index == 0:
            # A second answer nobody asked for, in the same packet: the next request on this
            # connection would read it as its own.
            writer.write(answer(b"stray"))
        await writer.drain()
        if index == 0:
            assert await reader.read() == b""  # the client hung up
            closed_by_client.set()

    async def scenario(url: str) -> None:
        pool = ConnectionPool(2)
        response = await pool.post(url, [], b"{}")
        assert await response.read() == b"first"
        response.release()
        await closed_by_client.wait()
        assert not any(pool._idle.values())
        response = await pool.post(url, [], b"{}")
        assert await response.read() == b"second"
        response.release()
        assert served == [1, 1]
        pool.close()

    serve(handler, scenario)


class ThreadServer:
    """A blocking server on its own thread: `handle(connection, index)` for each connection,
    numbered in the order they were accepted. Lets a test hold the client's event loop still
    while the server acts."""

    def __init__(self, handle: Callable[[socket.socket, int], None], rcvbuf: int = 0) -> None:
        self._handle = handle
        self._listener = socket.socket()
        if rcvbuf:  # inherited by accepted connections
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen()
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}/v1/completions"
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:  # closed: the test is over
                return
            index, self.accepted = self.accepted, self.accepted + 1
            threading.Thread(target=self._serve, args=(connection, index), daemon=True).start()

    def _serve(self, connection: socket.socket, index: int) -> None:
        with connection, contextlib.suppress(ConnectionError):  # a client may hang up first
            self._handle(connection, index)

    def close(self) -> None:
        self._listener.close()


@contextlib.contextmanager
def thread_server(
    handle: Callable[[socket.socket, int], None], rcvbuf: int = 0
) -> Iterator[ThreadServer]:
    server = ThreadServer(handle, rcvbuf)
    try:
        yield server
    finally:
        server.close()


def receive_request(connection: socket.socket) -> bytes | None:
    """The body of the next request on a blocking socket; None at its end."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = connection.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = content_length(head)
    while len(body) < length:
        chunk = connection.recv(1 << 20)
        if not chunk:
            return None
        body += chunk
    return body


@pytest.mark.parametrize("fault", ["close", "speak"])
def test_a_connection_that_went_stale_while_idle_is_dropped_when_taken(fault: str) -> None:
    faulted = threading.Event()
    requests = [0, 0]

    def handle(connection: socket.socket, index: int) -> None:
        while receive_request(connection) is not None:
            requests[index] += 1
            connection.sendall(answer(b"first" if index == 0 else b"second"))
            if index == 0:
                if fault == "close":
                    connection.shutdown(socket.SHUT_RDWR)
                else:
                    connection.sendall(b"HTTP/1.1 200 OK\r\n")
                faulted.set()

    async def scenario(url: str) -> None:
        resends: list[str] = []
        pool = ConnectionPool(2, on_resend=resends.append)
        response = await pool.post(url, [], b"{}")
        assert await response.read() == b"first"
        response.release()
        # Blocks the event loop: the client cannot have read the fault before it takes the
        # connection again.
        assert faulted.wait(10)
        response = await pool.post(url, [], b"{}")
        assert await response.read() == b"second"
        response.release()
        assert resends == []  # never written on the stale connection
        pool.close()

    with thread_server(handle) as server:
        asyncio.run(scenario(server.url))
        assert requests == [1, 1]


def test_a_request_the_replica_never_took_in_is_sent_again() -> None:
    bodies: list[list[int]] = [[], []]

    def handle(connection: socket.socket, index: int) -> None:
        if index == 0:
            bodies[0].append(len(receive_request(connection) or b""))
            connection.sendall(answer(b"first"))
            connection.recv(100)  # the second request has begun to arrive: close without it
            return
        body = receive_request(connection)
        bodies[1].append(len(body or b""))
        connection.sendall(answer(b"second"))
        receive_request(connection)

    async def scenario(url: str) -> None:
        resends: list[str] = []
        pool = ConnectionPool(2, on_resend=resends.append)
        response = await pool.post(url, [], b"{}")
        assert await response.read() == b"first"
        response.release()
        # Far more than the replica's small receive buffer takes in.
        response = await pool.post(url, [], b"x" * (4 << 20))
        assert await response.read() == b"second"
        response.release()
        assert resends == ["unacknowledged"]
        pool.close()

    with thread_server(handle, rcvbuf=4096) as server:
        asyncio.run(scenario(server.url))
        assert bodies == [[2], [4 << 20]]
        assert server.accepted == 2


def test_a_request_the_replica_may_have_read_is_not_sent_again() -> None:
    requests: list[bytes] = []

    def handle(connection: socket.socket, index: int) -> None:
        requests.append(receive_request(connection) or b"")
        connection.sendall(answer(b"first"))
        requests.append(receive_request(connection) or b"")
        # Read whole and never answered: the replica died working on it.

    async def scenario(url: str) -> None:
        resends: list[str] = []
        pool = ConnectionPool(2, on_resend=resends.append)
        response = await pool.post(url, [], b"{}")
        assert await response.read() == b"first"
        response.release()
        with pytest.raises(HTTPClientError) as caught:
            await pool.post(url, [], b'{"n": 2}')
        assert caught.value.cause == "closed"
        assert resends == []
        pool.close()

    with thread_server(handle) as server:
        asyncio.run(scenario(server.url))
        assert requests == [b"{}", b'{"n": 2}']
        assert server.accepted == 1


def test_a_request_whose_write_fails_is_sent_again() -> None:
    bodies: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            bodies.append(await read_request(reader))
            writer.write(answer(b"ok %d" % len(bodies)))
            await writer.drain()

    async def scenario(url: str) -> None:
        resends: list[str] = []
        pool = ConnectionPool(2, on_resend=resends.append)
        response = await pool.post(url, [], b"1")
        assert await response.read() == b"ok 1"
        response.release()
        # The kept-alive connection can no longer send (as when its network is gone); the
        # server, on this same event loop, has not run since.
        (idle,) = pool._idle.values()
        assert idle[-1].transport is not None
        kept = idle[-1].transport.get_extra_info("socket").fileno()
        with socket.fromfd(kept, socket.AF_INET, socket.SOCK_STREAM) as same:
            same.shutdown(socket.SHUT_WR)
        response = await pool.post(url, [], b"2")
        assert await response.read() == b"ok 2"
        response.release()
        assert resends == ["write_failed"]
        pool.close()

    serve(handler, scenario)
    assert bodies == [b"1", b"2"]
