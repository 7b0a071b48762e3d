"""A replica of a test's own that holds every chat request it receives until the test lets it
go: what it holds, in the order it came, is the test's to read, so that how many requests a
gateway lets through at once, and which goes first, can be asserted by order alone."""

from __future__ import annotations

import asyncio
import json
import threading

from tests.threaded_server import ThreadedServer


class HoldingReplica(ThreadedServer):
    def __init__(self) -> None:
        super().__init__()
        self.arrived: list[str] = []
        """The last user message of every request received, in order."""
        self.answered = 0
        self._lock = threading.Lock()
        self._releases: asyncio.Queue[None] | None = None

    @property
    def held(self) -> int:
        with self._lock:
            return len(self.arrived) - self.answered

    def release(self, count: int = 1) -> None:
        """Let the `count` oldest requests held be answered."""
        queue = self._releases
        assert queue is not None
        for _ in range(count):
            self._loop.call_soon_threadsafe(queue.put_nowait, None)

    async def _start(self) -> int:
        self._releases = asyncio.Queue()
        return await super()._start()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async for request in self.posts(reader, writer):
                messages = json.loads(request.body).get("messages")
                if not messages:  # not a chat request (the gateway's own probe): not held
                    writer.write(_answer(json.dumps({"object": "text_completion"}).encode()))
                    await writer.drain()
                    continue
                text = messages[-1]["content"]
                with self._lock:
                    self.arrived.append(text)
                assert self._releases is not None
                await self._releases.get()
                body = json.dumps(
                    {
                        "object": "chat.completion",
                        "choices": [
                            {"index": 0, "message": {"role": "assistant", "content": "ok"}}
                        ],
                        "usage": {"prompt_tokens": 20, "completion_tokens": 1, "total_tokens": 21},
                    }
                ).encode()
                with self._lock:
                    self.answered += 1
                writer.write(_answer(body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def _answer(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )
