"""Large replies pass through the gateway without being held: a replica of the test's own
answers a non-streamed chat or embeddings request with tens of megabytes of JSON, or a stream
of many tiny deltas; the client gets every byte, the usage at the body's end is counted, and
the gateway's peak memory grows far less than the reply."""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from prefix_gateway.proxy.usage import StreamObserver, usage_in_tail
from tests.conftest import MODEL
from tests.fault_servers import read_request
from tests.support import PATIENCE_SECONDS, GatewayProcess, metric_value, wait_until
from tests.threaded_server import ThreadedServer

_MIB = 1024 * 1024
_USAGE: dict[str, Any] = {
    "prompt_tokens": 1234,
    "completion_tokens": 56,
    "total_tokens": 1290,
    "prompt_tokens_details": {"cached_tokens": 1024},
}


def _chat_body(size: int) -> list[bytes]:
    head = json.dumps({"id": "chatcmpl-big", "object": "chat.completion", "model": MODEL})
    opening = head[:-1].encode() + b',"choices":[{"index":0,"message":{"role":"assistant",'
    closing = b'},"finish_reason":"stop"}],"usage":' + json.dumps(_USAGE).encode() + b"}"
    filler = size // _MIB
    return [opening + b'"content":"', *([b"a" * _MIB] * filler), b'"', closing]


def _embeddings_body(inputs: int, floats: int) -> list[bytes]:
    vector = b"[" + b",".join([b"0.0123456789"] * floats) + b"]"
    parts = [b'{"object":"list","data":[']
    for index in range(inputs):
        separator = b"," if index else b""
        parts.append(separator + b'{"object":"embedding","index":%d,"embedding":' % index)
        parts.append(vector + b"}")
    usage = json.dumps({"prompt_tokens": 777, "total_tokens": 777}).encode()
    parts.append(b'],"model":"' + MODEL.encode() + b'","usage":' + usage + b"}")
    return parts


def _stream_body(deltas: int) -> list[bytes]:
    event = json.dumps({"choices": [{"index": 0, "delta": {"content": "€"}}]}).encode()
    usage = json.dumps({"choices": [], "usage": _USAGE}).encode()
    block = (b"data: " + event + b"\n\n") * 1000
    return [block] * (deltas // 1000) + [b"data: " + usage + b"\n\ndata: [DONE]\n\n"]


class LargeReplica(ThreadedServer):
    """Answers every POST with one large body: chat with a content-length, embeddings
    chunked, a stream of tiny deltas for a request that asks for one."""

    def __init__(
        self, chat: list[bytes], embeddings: list[bytes], stream: list[bytes], cut: int = 0
    ) -> None:
        self.bodies = {"chat": chat, "embeddings": embeddings, "stream": stream}
        self.cut = cut
        """Parts of the chat body sent before the connection is dropped (0: all of them)."""
        super().__init__()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while (request := await read_request(reader)) is not None:
                path, body = request.path, request.body
                if request.method == "GET":
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                elif b"warm-up" in body:
                    small = json.dumps({"object": "chat.completion", "choices": []}).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(small))
                    writer.write(small)
                elif path == "/v1/embeddings":
                    await self._chunked(writer, self.bodies["embeddings"], b"application/json")
                elif b'"stream":true' in body.replace(b" ", b""):
                    await self._chunked(writer, self.bodies["stream"], b"text/event-stream")
                else:
                    parts = self.bodies["chat"]
                    size = sum(len(part) for part in parts)
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                        b"set-cookie: replica=1; Domain=example.com\r\n"
                        b"content-length: %d\r\n\r\n" % size
                    )
                    for part in parts[: self.cut or len(parts)]:
                        writer.write(part)
                        await writer.drain()
                    if self.cut:
                        return
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @staticmethod
    async def _chunked(writer: asyncio.StreamWriter, parts: list[bytes], kind: bytes) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: " + kind + b"\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        for part in parts:
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            await writer.drain()
        writer.write(b"0\r\n\r\n")


def _peak_rss(pid: int) -> int:
    """The process's peak resident memory so far, in bytes (Linux's VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def _digest(parts: list[bytes]) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    return digest.hexdigest()


def _fetch(url: str, payload: Mapping[str, object]) -> tuple[int, str, int, httpx.Headers]:
    """Status, digest and length of the body, read as it comes, and the headers."""
    digest = hashlib.sha256()
    size = 0
    with httpx.stream("POST", url, json=payload, timeout=120) as response:
        for chunk in response.iter_raw():
            digest.update(chunk)
            size += len(chunk)
        return response.status_code, digest.hexdigest(), size, response.headers


def _replica() -> LargeReplica:
    return LargeReplica(_chat_body(64 * _MIB), _embeddings_body(512, 4096), _stream_body(300_000))


@contextmanager
def _gateway(replica: LargeReplica, *args: str) -> Iterator[GatewayProcess]:
    specs = [f"{MODEL}={replica.url}"]
    with GatewayProcess(specs, "--max-prompt-tokens", "1000", *args) as gateway:
        # A small request first: what the process holds after its first answer is the base.
        small = httpx.post(
            gateway.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "warm-up"}]},
            timeout=120,
        )
        assert small.status_code == 200
        yield gateway


def test_a_large_chat_reply_is_passed_on_byte_for_byte_without_being_held() -> None:
    with _replica() as replica, _gateway(replica) as gateway:
        before = _peak_rss(gateway.pid)
        tokens_before = metric_value(gateway.metrics(), "gateway_upstream_prompt_tokens_total")
        payload = {"model": MODEL, "messages": [{"role": "user", "content": "big one"}]}
        status, digest, size, headers = _fetch(gateway.url + "/v1/chat/completions", payload)
        grown = _peak_rss(gateway.pid) - before
        chat = replica.bodies["chat"]
        assert status == 200
        assert (size, digest) == (sum(len(part) for part in chat), _digest(chat))
        assert headers["content-length"] == str(size)
        assert "set-cookie" not in headers  # a replica's cookies stay with the gateway
        assert grown < size / 2, f"peak memory grew {grown} bytes for a {size}-byte reply"
        text = gateway.metrics()
        counted = metric_value(text, "gateway_upstream_prompt_tokens_total") - tokens_before
        assert counted == _USAGE["prompt_tokens"]
        assert metric_value(text, "gateway_upstream_errors_total") == 0


def test_a_large_chunked_embeddings_reply_is_passed_on_with_its_usage() -> None:
    with _replica() as replica, _gateway(replica) as gateway:
        before = _peak_rss(gateway.pid)
        tokens_before = metric_value(gateway.metrics(), "gateway_upstream_prompt_tokens_total")
        payload = {"model": MODEL, "input": ["one", "two"]}
        status, digest, size, headers = _fetch(gateway.url + "/v1/embeddings", payload)
        grown = _peak_rss(gateway.pid) - before
        embeddings = replica.bodies["embeddings"]
        assert status == 200
        assert (size, digest) == (sum(len(part) for part in embeddings), _digest(embeddings))
        assert "content-length" not in headers  # the replica sent none: chunked on
        assert grown < size / 2, f"peak memory grew {grown} bytes for a {size}-byte reply"
        counted = (
            metric_value(gateway.metrics(), "gateway_upstream_prompt_tokens_total") - tokens_before
        )
        assert counted == 777


def test_a_long_stream_of_tiny_deltas_keeps_no_answer_past_the_prompt_bound() -> None:
    with _replica() as replica, _gateway(replica) as gateway:
        before = _peak_rss(gateway.pid)
        payload = {
            "model": MODEL,
            "stream": True,
            "messages": [{"role": "user", "content": "talk a lot"}],
        }
        status, digest, size, _ = _fetch(gateway.url + "/v1/chat/completions", payload)
        grown = _peak_rss(gateway.pid) - before
        stream = replica.bodies["stream"]
        assert status == 200
        assert (size, digest) == (sum(len(part) for part in stream), _digest(stream))
        # 300,000 deltas of one character: kept as a list, about 25 MB on their own.
        assert grown < 12 * _MIB, f"peak memory grew {grown} bytes for a {size}-byte stream"
        counted = metric_value(gateway.metrics(), "gateway_upstream_prompt_tokens_total")
        assert counted >= _USAGE["prompt_tokens"]


def test_a_client_that_reads_nothing_of_a_large_reply_has_its_request_ended() -> None:
    with (
        _replica() as replica,
        _gateway(replica, "--client-write-timeout", "1") as gateway,
        socket.socket() as client,
    ):
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect((gateway.host, gateway.port))
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "big"}]})
        head = f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}"
        client.sendall(
            head.encode() + b"\r\ncontent-type: application/json\r\n\r\n" + body.encode()
        )

        def ended() -> bool:
            return metric_value(gateway.metrics(), "gateway_client_disconnects_total") >= 1

        # The body waits in the gateway's socket buffer no longer than the write timeout.
        wait_until(ended, "the request of a client that reads nothing is ended")
        chat = httpx.post(
            gateway.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "warm-up"}]},
            timeout=60,
        )
        assert chat.status_code == 200


def test_a_large_reply_cut_short_reaches_the_client_short_of_its_length() -> None:
    with (
        LargeReplica(_chat_body(8 * _MIB), [], [], cut=4) as replica,
        _gateway(replica, "--failure-threshold", "1000") as gateway,
    ):
        payload = {"model": MODEL, "messages": [{"role": "user", "content": "big one"}]}
        with (
            pytest.raises(httpx.RemoteProtocolError),
            httpx.stream(
                "POST", gateway.url + "/v1/chat/completions", json=payload, timeout=PATIENCE_SECONDS
            ) as answer,
        ):
            assert answer.status_code == 200
            for _ in answer.iter_raw():
                pass
        text = gateway.metrics()
        assert metric_value(text, "gateway_upstream_errors_total", cause="stream_broken") == 1
        # Counted as a stream broken after its first byte is: 502.
        wait_until(
            lambda: '"stream":false' in gateway.log() and '"status":502' in gateway.log(),
            "the access line of a 502",
        )
        again = httpx.post(
            gateway.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "warm-up"}]},
            timeout=60,
        )
        assert again.status_code == 200


def test_a_200_that_is_not_json_is_relayed_as_it_is_and_held_against_its_replica() -> None:
    page = b"<html><body>upstream proxy: busy</body></html>"
    with (
        LargeReplica([page], [page], [page]) as replica,
        _gateway(replica, "--failure-threshold", "2", "--health-interval", "60") as gateway,
    ):
        url = gateway.url + "/v1/chat/completions"
        payload = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
        for _ in range(2):
            answer = httpx.post(url, json=payload, timeout=60)
            assert (answer.status_code, answer.content) == (200, page)
        text = gateway.metrics()
        name = replica.url.removeprefix("http://")
        malformed = metric_value(text, "gateway_upstream_errors_total", cause="malformed")
        assert malformed == 2
        assert metric_value(text, "gateway_backend_healthy", backend=name) == 0
        refused = httpx.post(url, json=payload, timeout=60)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "no_healthy_backend"


def test_an_answer_past_its_bound_is_dropped_not_recorded_in_part() -> None:
    observer = StreamObserver(answer_limit=100)
    delta = b'data: {"choices":[{"index":0,"delta":{"content":"xy"}}]}\n\n'
    observer.feed(delta * 40)
    assert observer.seen.answer == "xy" * 40
    observer.feed(delta * 40 + b"data: [DONE]\n\n")
    seen = observer.seen
    assert seen.complete and seen.answer_truncated
    assert seen.answer == "" and seen.answer_parts == []
    joined = StreamObserver(answer_limit=10**6)
    joined.feed(delta * 5000)
    assert len(joined.seen.answer_parts) <= 257 and joined.seen.answer == "xy" * 5000


def test_usage_is_found_in_a_body_s_tail_and_not_inside_a_string() -> None:
    tail = b'0.5]}],"note":"say \\"usage\\": {}","usage":{"prompt_tokens":3,"x":"}"}}'
    assert usage_in_tail(tail) == {"prompt_tokens": 3, "x": "}"}
    assert usage_in_tail(b'"usage":{"prompt_tokens":3') is None
    assert usage_in_tail(b"no usage here") is None
