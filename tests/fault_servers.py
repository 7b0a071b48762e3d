"""Misbehaving replicas for fault tests: a tiny HTTP/1.1 server with a fault mode.

Each `FaultServer` runs on its own event loop in a background thread on a free loopback port.
Its `mode` says what it does with inference requests (POST); `GET /health` answers 200 unless
the mode is `stall`, and other GETs 404. The mode can change while it runs.

- `ok`: a small, valid chat completion (JSON), or an SSE stream when the body asks for one;
- `stall`: accept the connection, read the request, never answer (probes included);
- `error`: 500 with a JSON error body;
- `garbage`: bytes that are not HTTP, then close;
- `cut`: a 200 stream of `cut_after` events, then the connection is dropped mid-response
  (non-streamed requests: a Content-Length that the body never reaches);
- `quiet`: a 200 stream of `cut_after` events, then silence on an open connection;
- `status`: `status` with `extra_headers` and a JSON error body (429s, 503s).

Every inference request is kept (`seen`), and every request of any kind (`every`: probes,
model listings, scrapes, adapter loads...), so tests can check what a replica is sent. With
`models`, `GET /v1/models` lists them (else it is a 404 as any other GET), and the LoRA
adapters loaded (`POST /v1/load_lora_adapter` in mode `ok`) until they are unloaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self

MODES = ("ok", "stall", "error", "garbage", "cut", "quiet", "status")


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class FaultServer:
    mode: str = "ok"
    cut_after: int = 2
    status: int = 503
    extra_headers: dict[str, str] = field(default_factory=dict)
    gap: float = 0.005
    """Seconds between two events of a stream."""
    answer: str = "fine"
    """The text of every answer (streamed: one event per word, with its index)."""
    host: str = "127.0.0.1"
    port: int = 0
    seen: list[Request] = field(default_factory=list)
    probes: int = 0
    every: list[Request] = field(default_factory=list)
    """Every request received, whatever its method and path."""
    models: list[str] = field(default_factory=list)
    """Listed by `GET /v1/models` (none: a 404)."""
    adapters: list[str] = field(default_factory=list)
    """LoRA adapters loaded, listed with the first model as their parent."""
    probe_headers: dict[str, str] = field(default_factory=dict)
    """The headers of the last health probe."""
    stalled: int = 0
    """Inference requests left unanswered (mode `stall`)."""
    cut: int = 0
    """Responses dropped in the middle (mode `cut`)."""

    def __post_init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stopped: asyncio.Event | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def posts(self) -> int:
        return len(self.seen)

    def start(self) -> Self:
        self._thread = threading.Thread(target=self._serve, name="fault-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fault server did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stopped is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop()

    def _serve(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        server = await asyncio.start_server(self._connection, self.host, self.port)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        async with server:
            await self._stopped.wait()
            for writer in list(self._writers):
                writer.transport.abort()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                request = await read_request(reader)
                if request is None:
                    return
                self.every.append(request)
                if request.method == "GET" and request.path == "/v1/models" and self.models:
                    cards = [_card(name) for name in self.models]
                    cards += [_card(name, self.models[0]) for name in self.adapters]
                    listing = {"object": "list", "data": cards}
                    await _respond(writer, 200, json.dumps(listing).encode(), _JSON)
                    continue
                if request.path in _ADAPTER_PATHS and self.mode == "ok":
                    name = json.loads(request.body)["lora_name"]
                    if request.path == "/v1/load_lora_adapter":
                        self.adapters.append(name)
                    elif name in self.adapters:
                        self.adapters.remove(name)
                    await _respond(writer, 200, b"Success")
                    continue
                if request.method == "GET" and request.path == "/health":
                    self.probes += 1
                    self.probe_headers = request.headers
                    if self.mode == "stall":
                        await asyncio.Event().wait()
                    await _respond(writer, 200, b"")
                    continue
                if request.method != "POST":  # e.g. a scrape of /metrics: not a fault target
                    await _respond(writer, 404, _error("not found"), _JSON)
                    continue
                self.seen.append(request)
                if not await self._answer(request, writer):
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        except asyncio.CancelledError:  # the server is stopping: nothing left to answer
            return
        finally:
            self._writers.discard(writer)
            writer.transport.abort()

    async def _answer(self, request: Request, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; False when the connection is to be dropped."""
        mode = self.mode
        streaming = b'"stream": true' in request.body or b'"stream":true' in request.body
        if mode == "stall":
            self.stalled += 1
            await asyncio.Event().wait()
        if mode == "garbage":
            writer.write(b"\x00\xffTHIS IS NOT HTTP\r\n\r\n")
            await writer.drain()
            return False
        if mode == "error":
            await _respond(writer, 500, _error("the replica failed"), _JSON)
            return True
        if mode == "status":
            headers = {**_JSON, **self.extra_headers}
            await _respond(writer, self.status, _error("try elsewhere"), headers)
            return True
        if not streaming:
            body = json.dumps(_completion(self.answer)).encode()
            if mode == "cut":
                self.cut += 1
                head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                writer.write(head + b"content-length: %d\r\n\r\n" % len(body) + body[:10])
                await writer.drain()
                return False
            await _respond(writer, 200, body, _JSON)
            return True
        head = (
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        writer.write(head)
        events = self.cut_after if mode in ("cut", "quiet") else 3
        for index in range(events):
            event = b"data: " + json.dumps(_chunk(f"{self.answer}{index} ")).encode() + b"\n\n"
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.sleep(self.gap)
        if mode == "cut":
            self.cut += 1
            return False
        if mode == "quiet":
            await asyncio.Event().wait()
        done = b"data: [DONE]\n\n"
        writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
        await writer.drain()
        return True


_JSON = {"content-type": "application/json"}


async def read_request(reader: asyncio.StreamReader) -> Request | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    body = b""
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    return Request(method, path, headers, body)


async def _respond(
    writer: asyncio.StreamWriter, status: int, body: bytes, headers: dict[str, str] | None = None
) -> None:
    lines = [f"HTTP/1.1 {status} X", f"content-length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
    with contextlib.suppress(ConnectionError):
        await writer.drain()


_ADAPTER_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


def _card(model: str, parent: str | None = None) -> dict[str, object]:
    return {"id": model, "object": "model", "created": 0, "owned_by": "fault", "parent": parent}


def _error(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "server_error"}}).encode()


def _completion(answer: str) -> dict[str, object]:
    return {
        "id": "chatcmpl-fault",
        "object": "chat.completion",
        "created": 0,
        "model": "fault-model",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": answer},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }


def _chunk(text: str) -> dict[str, object]:
    return {
        "id": "chatcmpl-fault",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "fault-model",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
    }
