"""A TCP server of a test's own on 127.0.0.1, served by an event loop on a thread of its
own so that the test around it can block: subclasses answer each connection in `_handle`.
Connections still open when it stops are aborted."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Self

from tests.fault_servers import Request, read_request


class ThreadedServer:
    def __init__(self) -> None:
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._connections: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Self:
        self._thread.start()
        started = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        self.port = started.result(30)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    @staticmethod
    async def posts(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> AsyncIterator[Request]:
        """The requests sent on this connection but the gateway's probes (a GET, answered 200
        with nothing)."""
        while (request := await read_request(reader)) is not None:
            if request.method == "GET":
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                await writer.drain()
                continue
            yield request

    async def _start(self) -> int:
        self._server = await asyncio.start_server(self._connected, "127.0.0.1", 0)
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def _stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        # Ended on the running loop: left pending, they were destroyed with it, and their
        # sockets reported unclosed during whichever test the garbage collector ran in.
        for connection in self._connections:
            connection.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await self._server.wait_closed()

    async def _connected(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        connection = asyncio.current_task()
        assert connection is not None
        self._writers.add(writer)
        self._connections.add(connection)
        try:
            await self._handle(reader, writer)
        finally:
            self._writers.discard(writer)
            self._connections.discard(connection)
            writer.close()
