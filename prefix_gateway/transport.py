"""The client side's transport under the HTTP server: a response's head goes out with the
write that follows it, in one system call instead of two.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast


class CoalescingTransport:
    """A transport that sends a response's head with the write that follows it (uvicorn writes
    them apart: two system calls), or at the end of the loop's turn if nothing follows."""

    __slots__ = ("_loop", "_pending", "_transport")

    def __init__(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._loop = asyncio.get_running_loop()
        self._pending: bytes | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        pending = self._pending
        if pending is not None:
            self._pending = None
            self._transport.write(pending + bytes(data))
        elif data[:9] == b"HTTP/1.1 ":
            self._pending = bytes(data)
            self._loop.call_soon(self.flush)
        else:
            self._transport.write(data)

    def flush(self) -> None:
        pending = self._pending
        if pending is not None:
            self._pending = None
            self._transport.write(pending)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def get_write_buffer_size(self) -> int:
        held = len(self._pending) if self._pending is not None else 0
        return self._transport.get_write_buffer_size() + held

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
