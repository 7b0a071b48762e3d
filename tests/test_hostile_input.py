"""Hostile input at the request edge: every input path bounded from its first byte.

One gateway (module fixture) in front of the emulated replicas, plus a recording replica for
one model, with small limits so that each attack plays out in seconds. Attacks go through raw
sockets; beside each, a thread sends normal requests, which must keep succeeding.
"""

from __future__ import annotations

import re
import select
import socket
import threading
import time
from collections.abc import Iterator
from types import TracebackType

import httpx
import orjson
import pytest

from gateway.emulator.replicas import EmulatedReplicas
from tests.conftest import MODEL
from tests.fault_servers import FaultServer
from tests.support import GatewayProcess, metric_value

MAX_HEADER_BYTES = 8192
MAX_HEADERS = 50
HEAD_TIMEOUT = 2.0
BODY_TIMEOUT = 4.0
MAX_BODY = 100_000
MAX_PENDING = 350_000
RECORDED = "recorded-model"
"""A model served by the recording replica: what the gateway forwards can be read there."""


@pytest.fixture(scope="module")
def recorder() -> Iterator[FaultServer]:
    with FaultServer() as server:
        yield server


@pytest.fixture(scope="module")
def edge(fleet: EmulatedReplicas, recorder: FaultServer) -> Iterator[GatewayProcess]:
    args = ["--backend", f"{RECORDED}={recorder.url}"]
    args += ["--max-header-bytes", str(MAX_HEADER_BYTES), "--max-headers", str(MAX_HEADERS)]
    args += ["--head-timeout", str(HEAD_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT)]
    args += ["--max-body-bytes", str(MAX_BODY), "--max-pending-body-bytes", str(MAX_PENDING)]
    args += ["--max-concurrency", "1"]
    with GatewayProcess(fleet.urls, *args) as gateway:
        yield gateway


class NormalTraffic:
    """Normal chat requests, one after another in a thread, for as long as an attack runs."""

    def __init__(self, gateway: GatewayProcess) -> None:
        self._url = gateway.url + "/v1/chat/completions"
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def ok(self) -> int:
        return self.statuses.count(200)

    def wait_for(self, successes: int, seconds: float = 30.0) -> None:
        deadline = time.monotonic() + seconds
        while self.ok < successes and time.monotonic() < deadline:
            time.sleep(0.05)

    def _run(self) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                try:
                    self.statuses.append(client.post(self._url, json=body).status_code)
                except httpx.HTTPError:
                    self.statuses.append(0)
                self._stop.wait(0.05)

    def __enter__(self) -> NormalTraffic:
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.wait_for(1)
        self._stop.set()
        self._thread.join(35)

    def assert_served(self) -> None:
        assert self.ok >= 1 and set(self.statuses) == {200}, self.statuses


def _connect(gateway: GatewayProcess) -> socket.socket:
    raw = socket.create_connection(("127.0.0.1", gateway.port))
    raw.settimeout(30)
    return raw


def _answered(raw: socket.socket) -> bool:
    return bool(select.select([raw], [], [], 0)[0])


def _read_to_close(raw: socket.socket) -> bytes:
    """Everything the gateway sends until it closes the connection."""
    received = b""
    try:
        while chunk := raw.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    return received


def _error_code(reply: bytes) -> str:
    return str(orjson.loads(reply.partition(b"\r\n\r\n")[2])["error"]["code"])


def _head(length: int | None = None, extra: bytes = b"") -> bytes:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    if length is not None:
        head += b"content-length: %d\r\n" % length
    return head + extra + b"\r\n"


def _chat(content: str = "hello", model: str = MODEL) -> bytes:
    return orjson.dumps({"model": model, "messages": [{"role": "user", "content": content}]})


def test_a_huge_header_line_gets_431_before_much_of_it_was_read(edge: GatewayProcess) -> None:
    piece = b"b" * 65536
    with NormalTraffic(edge) as traffic, _connect(edge) as raw:
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
        raw.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-padding: ")
        sent = 0
        try:  # one 64 MiB header line, streamed until the gateway answers or closes
            while sent < 64 * 2**20 and not _answered(raw):
                raw.sendall(piece)
                sent += len(piece)
        except OSError:
            pass  # closed while we were sending
        reply = _read_to_close(raw)
        traffic.wait_for(3)
    assert reply.startswith(b"HTTP/1.1 431 ") and _error_code(reply) == "headers_too_large"
    # What the client could send is the limit plus what the sockets' buffers held meanwhile.
    assert sent < 4 * 2**20
    traffic.assert_served()
    assert metric_value(edge.metrics(), "gateway_rejected_requests_total", status="431") >= 1


def test_too_many_header_lines_get_431(edge: GatewayProcess) -> None:
    lines = b"".join(b"x-%d: 1\r\n" % index for index in range(MAX_HEADERS + 1))
    with NormalTraffic(edge) as traffic, _connect(edge) as raw:
        raw.sendall(_head(0, lines))
        reply = _read_to_close(raw)
    assert reply.startswith(b"HTTP/1.1 431 ") and _error_code(reply) == "too_many_headers"
    traffic.assert_served()


def test_a_head_near_the_limit_arriving_with_its_body_in_one_write_is_served(
    edge: GatewayProcess,
) -> None:
    body = _chat("y" * 60_000)
    padding = b"x-padding: " + b"p" * (MAX_HEADER_BYTES - 300) + b"\r\n"
    with _connect(edge) as raw:
        raw.sendall(_head(len(body), padding + b"connection: close\r\n") + body)
        reply = _read_to_close(raw)
    assert reply.startswith(b"HTTP/1.1 200 "), reply[:200]


def test_a_head_that_never_ends_gets_408_after_the_head_timeout(edge: GatewayProcess) -> None:
    with NormalTraffic(edge) as traffic, _connect(edge) as trickle, _connect(edge) as idle:
        trickle.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-slow: ")
        trickled = 0
        try:  # a byte every 0.2 s: the head never goes quiet, and never ends
            while not _answered(trickle) and trickled < 150:
                trickle.sendall(b"s")
                trickled += 1
                time.sleep(0.2)
        except OSError:
            pass
        reply = _read_to_close(trickle)
        unanswered = _read_to_close(idle)
    assert reply.startswith(b"HTTP/1.1 408 ") and _error_code(reply) == "head_timeout"
    assert trickled > 1  # the connection took bytes for a while before the timeout closed it
    assert unanswered == b""  # a connection that sent nothing is closed without an answer
    traffic.assert_served()


def test_slow_bodies_hold_no_concurrency_slot(edge: GatewayProcess) -> None:
    """`--max-concurrency 1`: two clients sending their bodies slowly block nobody."""
    slow = [_connect(edge), _connect(edge)]
    for raw in slow:
        raw.sendall(_head(1000) + b'{"model": ')
    served_while_open = False
    with NormalTraffic(edge) as traffic:
        for _ in range(150):  # a byte each 0.2 s until the body timeout answers them
            if all(_answered(raw) for raw in slow):
                break
            if traffic.ok >= 2 and not any(_answered(raw) for raw in slow):
                served_while_open = True
            for raw in slow:
                if not _answered(raw):
                    raw.sendall(b" ")
            time.sleep(0.2)
        replies = [_read_to_close(raw) for raw in slow]
    for raw in slow:
        raw.close()
    assert served_while_open  # normal requests were served while both slow bodies held on
    for reply in replies:
        assert reply.startswith(b"HTTP/1.1 408 ") and _error_code(reply) == "body_timeout"
    traffic.assert_served()


def test_bodies_being_read_are_bounded_together(edge: GatewayProcess) -> None:
    """Three stalled bodies of 90 kB hold 270 kB of the 350 kB budget: a fourth is refused."""
    stalled = [_connect(edge) for _ in range(3)]
    for raw in stalled:
        raw.sendall(_head(MAX_BODY) + b"z" * 90_000)
    refused = b""
    with NormalTraffic(edge) as traffic:
        for _ in range(20):
            with _connect(edge) as fourth:
                fourth.sendall(_head(MAX_BODY))
                if select.select([fourth], [], [], 0.5)[0]:
                    refused = _read_to_close(fourth)
                    break
        traffic.wait_for(3)
        replies = [_read_to_close(raw) for raw in stalled]  # their body timeout ends them
    for raw in stalled:
        raw.close()
    assert refused.startswith(b"HTTP/1.1 429 ") and _error_code(refused) == "pending_bodies"
    assert b"\r\nretry-after: 1\r\n" in refused.lower()
    assert all(_error_code(reply) == "body_timeout" for reply in replies)
    traffic.assert_served()  # small bodies still fit beside them
    # Once the stalled bodies are gone, their bytes are free again.
    whole = _chat("w" * (MAX_BODY - 200))
    response = httpx.post(edge.url + "/v1/chat/completions", content=whole, timeout=30)
    assert response.status_code == 200


def test_request_ids_must_be_short_tokens(edge: GatewayProcess, recorder: FaultServer) -> None:
    url = edge.url + "/v1/chat/completions"
    kept = "client-7.trace:abc_1"
    hostile: list[bytes] = [b"a" * 129, b"a" * 4000, "café".encode(), b"two words", b"../../etc"]
    used_ids = []
    with NormalTraffic(edge) as traffic:
        response = httpx.post(url, content=_chat(model=RECORDED), headers={"x-request-id": kept})
        assert response.status_code == 200
        assert response.headers["x-request-id"] == kept == recorder.seen[-1].headers["x-request-id"]
        for given in hostile:
            response = httpx.post(
                url, content=_chat(model=RECORDED), headers={"x-request-id": given}
            )
            assert response.status_code == 200
            used = response.headers["x-request-id"]
            assert re.fullmatch(r"[0-9a-f]{32}", used)  # the gateway's own
            assert recorder.seen[-1].headers["x-request-id"] == used
            used_ids.append(used)
    assert len(set(used_ids)) == len(hostile)
    log = _access_log_with(edge, used_ids)
    assert "a" * 129 not in log and "café" not in log
    traffic.assert_served()


def _access_log_with(gateway: GatewayProcess, request_ids: list[str]) -> str:
    """The gateway's output once its access log (written in batches) names every id."""
    for _ in range(100):
        log = gateway.log()
        if all(request_id in log for request_id in request_ids):
            return log
        time.sleep(0.1)
    raise AssertionError(f"not logged: {request_ids}")


def test_a_body_over_the_limit_gets_413(edge: GatewayProcess) -> None:
    with NormalTraffic(edge) as traffic:
        # Declared too large: refused before a byte of it is sent, and the connection closed.
        with _connect(edge) as raw:
            raw.sendall(_head(MAX_BODY + 1))
            declared = _read_to_close(raw)
        # Chunked, with no length given: refused once the limit is passed.
        chunks = (b"x" * 10_000 for _ in range(30))
        streamed = httpx.post(edge.url + "/v1/chat/completions", content=chunks, timeout=30)
        at_limit = _chat("w" * (MAX_BODY - 200))
        assert len(at_limit) <= MAX_BODY
        accepted = httpx.post(edge.url + "/v1/chat/completions", content=at_limit, timeout=30)
    assert declared.startswith(b"HTTP/1.1 413 ") and _error_code(declared) == "body_too_large"
    assert b"connection: close" in declared.lower()
    assert streamed.status_code == 413 and streamed.json()["error"]["code"] == "body_too_large"
    assert accepted.status_code == 200
    traffic.assert_served()


def test_connections_past_the_cap_get_503_and_idle_ones_are_closed(
    fleet: EmulatedReplicas,
) -> None:
    args = ("--max-connections", "8", "--head-timeout", str(HEAD_TIMEOUT))
    with GatewayProcess(fleet.urls, *args) as gateway:
        idle = [_connect(gateway) for _ in range(8)]
        with _connect(gateway) as extra:
            refused = _read_to_close(extra)
        # The idle connections are closed by the head timeout, without an answer ...
        closed = [_read_to_close(raw) for raw in idle]
        for raw in idle:
            raw.close()
        # ... and the gateway serves again.
        with NormalTraffic(gateway) as traffic:
            traffic.wait_for(3)
    assert refused.startswith(b"HTTP/1.1 503 ") and _error_code(refused) == "too_many_connections"
    assert closed == [b""] * 8
    traffic.assert_served()
