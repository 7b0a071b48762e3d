"""The client side's transport under the HTTP server: a response's head goes out with the
write that follows it, in one system call instead of two; and whether the client has hung up
can be asked of its socket before the event loop has read the hang-up.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any, cast

_PEEK = int(socket.MSG_PEEK | socket.MSG_DONTWAIT)  # combined once: the flags are an enum


class CoalescingTransport:
    """A transport that sends a response's head with the write that follows it (uvicorn writes
    them apart: two system calls), or at the end of the loop's turn if nothing follows."""

    __slots__ = ("_loop", "_peek", "_pending", "_transport")

    def __init__(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._loop = asyncio.get_running_loop()
        self._pending: bytes | None = None
        self._peek: socket.socket | None = None
        """The connection's socket, borrowed to peek at (never closed through it)."""

    def hung_up(self) -> bool:
        """Whether the client has closed its side, as its socket says now: a request it sent
        just before hanging up is then not passed on, though the loop has not read the
        hang-up yet (one system call)."""
        if self._transport.is_closing():
            return True
        peek = self._peek
        if peek is None:
            raw = self._transport.get_extra_info("socket")
            if raw is None:
                return False
            peek = self._peek = socket.socket(fileno=raw.fileno())
        try:
            return peek.recv(1, _PEEK) == b""
        except (BlockingIOError, InterruptedError):
            return False  # nothing to read: still there
        except OSError:
            return True

    def lost(self) -> None:
        """The connection is lost: the borrowed socket is let go without closing it (its file
        descriptor is the transport's, and may soon be another connection's)."""
        if self._peek is not None:
            self._peek.detach()
            self._peek = None

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
