"""Hostile input: every input path bounded from its first byte, and secure by default.

At the request edge, one gateway (module fixture) in front of the emulated replicas, plus a
recording replica for one model, with small limits so that each attack plays out in seconds;
attacks go through raw sockets. Then the admin API, what replicas are sent, loops, session
keys, parse limits, errors, metrics and tenants, each on a gateway of its own. Beside each
attack normal requests must keep succeeding.
"""

from __future__ import annotations

import dataclasses
import re
import select
import socket
import threading
import time
from collections.abc import Iterator
from types import TracebackType

import httpx
import openai
import orjson
import pytest

from prefix_gateway.auth import AdminAccess, is_loopback
from prefix_gateway.config import ConfigError, Settings
from prefix_gateway.emulator.replicas import EmulatedReplicas
from prefix_gateway.processes import free_port
from tests.conftest import MODEL
from tests.fault_servers import FaultServer
from tests.support import PATIENCE_SECONDS, GatewayProcess, metric_value, read_to_close, wait_until

MAX_HEADER_BYTES = 8192
MAX_HEADERS = 50
HEAD_TIMEOUT = 2.0
# Long beside a request's round trip on a busy machine: normal requests are answered while
# slow bodies are held open, until this ends them.
BODY_TIMEOUT = 10.0
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

    def wait_for(self, successes: int) -> None:
        wait_until(lambda: self.ok >= successes, f"{successes} normal requests answered 200")

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
        if error is None:
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
        reply = read_to_close(raw)
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
        reply = read_to_close(raw)
    assert reply.startswith(b"HTTP/1.1 431 ") and _error_code(reply) == "too_many_headers"
    traffic.assert_served()


def test_a_head_near_the_limit_arriving_with_its_body_in_one_write_is_served(
    edge: GatewayProcess,
) -> None:
    body = _chat("y" * 60_000)
    padding = b"x-padding: " + b"p" * (MAX_HEADER_BYTES - 300) + b"\r\n"
    with _connect(edge) as raw:
        raw.sendall(_head(len(body), padding + b"connection: close\r\n") + body)
        reply = read_to_close(raw)
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
        reply = read_to_close(trickle)
        unanswered = read_to_close(idle)
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
        replies = [read_to_close(raw) for raw in slow]
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
                    refused = read_to_close(fourth)
                    break
        traffic.wait_for(3)
        replies = [read_to_close(raw) for raw in stalled]  # their body timeout ends them
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
        response = httpx.post(
            url,
            content=_chat(model=RECORDED),
            headers={"x-request-id": kept},
            timeout=PATIENCE_SECONDS,
        )
        assert response.status_code == 200
        assert response.headers["x-request-id"] == kept == recorder.seen[-1].headers["x-request-id"]
        for given in hostile:
            response = httpx.post(
                url,
                content=_chat(model=RECORDED),
                headers={"x-request-id": given},
                timeout=PATIENCE_SECONDS,
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
            declared = read_to_close(raw)
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


def test_the_responses_paths_and_model_only_endpoints_keep_the_bounds(
    edge: GatewayProcess,
) -> None:
    long_id = "r" * 129
    with NormalTraffic(edge) as traffic:
        too_large = {
            (method, path): httpx.request(
                method, edge.url + path, content=b"x" * (MAX_BODY + 1), timeout=30
            ).json()["error"]["code"]
            for method, path in (
                ("POST", "/v1/responses"),
                ("GET", "/v1/responses/resp_1"),
                ("DELETE", "/v1/responses/resp_1"),
                ("POST", "/v1/responses/resp_1/cancel"),
                ("POST", "/tokenize"),
            )
        }
        by_long_id = httpx.get(edge.url + "/v1/responses/" + long_id, timeout=PATIENCE_SECONDS)
        follow_up = {"model": MODEL, "input": "hi", "previous_response_id": long_id}
        long_previous = httpx.post(
            edge.url + "/v1/responses", json=follow_up, timeout=PATIENCE_SECONDS
        )
        many = b'{"model":"m","input":[' + b",".join([b"{}"] * 10_001) + b"]}"
        many_items = httpx.post(edge.url + "/v1/responses", content=many, timeout=PATIENCE_SECONDS)
        nested = b'{"model":"m","input":' + b"[" * 300 + b"]" * 300 + b"}"
        deep = httpx.post(edge.url + "/v1/responses", content=nested, timeout=PATIENCE_SECONDS)
    assert set(too_large.values()) == {"body_too_large"}, too_large
    assert by_long_id.status_code == 400 and long_previous.status_code == 400
    assert by_long_id.json()["error"]["code"] == "invalid_response_id"
    assert long_previous.json()["error"]["param"] == "previous_response_id"
    assert many_items.status_code == 400 and many_items.json()["error"]["code"] == "too_many_items"
    assert deep.status_code == 400 and deep.json()["error"]["code"] == "too_deep"
    traffic.assert_served()


def test_connections_past_the_cap_get_503_and_idle_ones_are_closed(
    fleet: EmulatedReplicas,
) -> None:
    args = ("--max-connections", "8", "--head-timeout", str(HEAD_TIMEOUT))
    with GatewayProcess(fleet.urls, *args) as gateway:
        idle = [_connect(gateway) for _ in range(8)]
        with _connect(gateway) as extra:
            refused = read_to_close(extra)
        # The idle connections are closed by the head timeout, without an answer ...
        closed = [read_to_close(raw) for raw in idle]
        for raw in idle:
            raw.close()
        # ... and the gateway serves again.
        with NormalTraffic(gateway) as traffic:
            traffic.wait_for(3)
    assert refused.startswith(b"HTTP/1.1 503 ") and _error_code(refused) == "too_many_connections"
    assert closed == [b""] * 8
    traffic.assert_served()


# --- secure by default: the admin API, what replicas are sent, loops, keys and tenants ------

TOKEN = "admin-secret"
BEARER = {"authorization": f"Bearer {TOKEN}"}


class WideGateway(GatewayProcess):
    """A gateway listening on every address (as in a cluster), asked on loopback only."""

    def __init__(self, backends: list[str], *args: str) -> None:
        super().__init__(backends, *args)
        self.host = "0.0.0.0"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def ask(url: str, content: str = "hello", **headers: str) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=20)


def test_who_may_use_the_admin_api() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    assert AdminAccess("", "127.0.0.1").open
    assert AdminAccess("", "0.0.0.0").disabled
    guarded = AdminAccess(TOKEN, "0.0.0.0")
    assert not guarded.open and not guarded.disabled
    guarded.check(f"Bearer {TOKEN}".encode())


def test_beyond_loopback_the_admin_api_is_off_without_a_token(fleet: EmulatedReplicas) -> None:
    with WideGateway(fleet.urls) as gateway:
        for method, path in (
            ("GET", "/admin/backends"),
            ("POST", "/admin/backends"),
            ("POST", "/admin/explain"),
            ("DELETE", f"/admin/backends/{fleet.urls[0].removeprefix('http://')}"),
        ):
            refused = httpx.request(
                method, gateway.url + path, json={"url": "http://x:1"}, timeout=PATIENCE_SECONDS
            )
            assert refused.status_code == 403, (method, path)
            assert refused.json()["error"]["code"] == "admin_disabled"
        assert ask(gateway.url).status_code == 200
        listed = httpx.get(gateway.url + "/v1/models", timeout=PATIENCE_SECONDS).json()["data"]
        assert [model["id"] for model in listed] == [MODEL]


def test_beyond_loopback_the_token_opens_it(fleet: EmulatedReplicas) -> None:
    with WideGateway(fleet.urls, "--admin-token", TOKEN) as gateway:
        assert (
            httpx.get(gateway.url + "/admin/backends", timeout=PATIENCE_SECONDS).status_code == 401
        )
        wrong = httpx.get(
            gateway.url + "/admin/backends",
            headers={"authorization": "Bearer no"},
            timeout=PATIENCE_SECONDS,
        )
        assert wrong.status_code == 403 and wrong.json()["error"]["code"] == "invalid_token"
        assert (
            httpx.get(
                gateway.url + "/admin/backends", headers=BEARER, timeout=PATIENCE_SECONDS
            ).status_code
            == 200
        )


def test_an_added_backend_url_is_checked(fleet: EmulatedReplicas) -> None:
    refused = [
        "http://user:password@10.0.0.1:8000",
        "http://10.0.0.1:8000 ",
        "http://10.0.0.1:8000\r\nx-injected: 1",
        "http://10.0.0.1:8000/v1?redirect=x",
        "file:///etc/passwd",
        "http://10.0.0.1:99999",
    ]
    with GatewayProcess(fleet.urls, "--admin-token", TOKEN) as gateway:
        for url in refused:
            added = httpx.post(
                gateway.url + "/admin/backends",
                json={"url": url},
                headers=BEARER,
                timeout=PATIENCE_SECONDS,
            )
            assert added.status_code == 400, url
            assert added.json()["error"]["code"] == "invalid_backend"
        listing = httpx.get(
            gateway.url + "/admin/backends", headers=BEARER, timeout=PATIENCE_SECONDS
        ).json()["data"]
        assert len(listing) == len(fleet.urls)
        assert ask(gateway.url).status_code == 200


def test_the_gateway_cannot_be_added_to_itself(fleet: EmulatedReplicas) -> None:
    with GatewayProcess(fleet.urls, "--admin-token", TOKEN) as gateway:
        for url in (
            gateway.url,
            f"http://localhost:{gateway.port}",
            f"http://127.0.0.9:{gateway.port}",
        ):
            added = httpx.post(
                gateway.url + "/admin/backends",
                json={"url": url},
                headers=BEARER,
                timeout=PATIENCE_SECONDS,
            )
            assert added.status_code == 400, url
        assert ask(gateway.url).status_code == 200


def test_a_request_that_comes_back_stops_after_one_hop(fleet: EmulatedReplicas) -> None:
    # A backend that is the gateway itself, under a name validation cannot see through.
    port = free_port()
    own = f"{MODEL}-loop=http://127.0.0.1:{port}"
    gateway = GatewayProcess([*fleet.urls, own], "--max-attempts", "1")
    gateway.port = port
    with gateway:
        # Its probe of itself passes once it listens.
        wait_until(
            lambda: all(
                item["healthy"]
                for item in httpx.get(
                    gateway.url + "/admin/backends", timeout=PATIENCE_SECONDS
                ).json()["data"]
            ),
            "every backend healthy, the gateway itself too",
        )
        body = {"model": f"{MODEL}-loop", "messages": [{"role": "user", "content": "x"}]}
        looped = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=20)
        assert looped.status_code == 508
        assert looped.json()["error"]["code"] == "loop_detected"
        text = gateway.metrics()
        # The client's request and the one that came back: one extra hop, no more.
        assert metric_value(text, "gateway_rejected_requests_total", status="508") == 1
        assert ask(gateway.url).status_code == 200


def test_the_upstream_key_goes_only_to_configured_backends() -> None:
    with (
        FaultServer() as configured,
        FaultServer() as added,
        GatewayProcess(
            [f"{MODEL}={configured.url}"],
            "--admin-token",
            TOKEN,
            "--upstream-api-key",
            "replica-key",
            "--max-attempts",
            "1",
        ) as gateway,
    ):
        response = httpx.post(
            gateway.url + "/admin/backends",
            json={"url": added.url, "model": MODEL},
            headers=BEARER,
            timeout=PATIENCE_SECONDS,
        )
        assert response.status_code == 201
        for turn in range(8):
            assert (
                ask(gateway.url, f"turn {turn}", authorization="Bearer client").status_code == 200
            )
        assert configured.seen and added.seen
        assert {r.headers.get("authorization") for r in configured.seen} == {"Bearer replica-key"}
        assert {r.headers.get("authorization") for r in added.seen} == {None}


def test_hop_by_hop_headers_stop_and_forwarding_headers_are_added() -> None:
    with FaultServer() as replica, GatewayProcess([f"{MODEL}={replica.url}"]) as gateway:
        response = ask(
            gateway.url,
            connection="keep-alive, x-secret-hop",
            **{
                "x-secret-hop": "1",
                "proxy-connection": "keep-alive",
                "x-forwarded-for": "203.0.113.7",
                "x-kept": "yes",
            },
        )
        assert response.status_code == 200
        seen = replica.seen[-1].headers
        assert "x-secret-hop" not in seen and "proxy-connection" not in seen
        assert seen["x-kept"] == "yes"
        assert seen["x-forwarded-for"] == "203.0.113.7, 127.0.0.1"
        assert seen["x-forwarded-proto"] == "http"
        assert "prefix-gateway" in seen["via"]


def test_session_keys_are_bounded_and_kept_only_as_hashes(fleet: EmulatedReplicas) -> None:
    with GatewayProcess(fleet.urls) as gateway:
        long = ask(gateway.url, **{"x-session-id": "k" * 513})
        assert long.status_code == 400
        assert long.json()["error"]["code"] == "session_key_too_long"
        explained = httpx.post(
            gateway.url + "/admin/explain",
            json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
            headers={"x-session-id": "secret-session"},
            timeout=PATIENCE_SECONDS,
        ).json()
        assert explained["session_key"] != "secret-session" and len(explained["session_key"]) == 16
        assert ask(gateway.url, **{"x-session-id": "k" * 512}).status_code == 200


def test_a_body_of_nested_arrays_is_refused_before_it_is_parsed(
    fleet: EmulatedReplicas,
) -> None:
    with GatewayProcess(fleet.urls) as gateway:
        nested = (
            b'{"model":"m","messages":[{"role":"user","content":"x"}],"tools":'
            + (b"[" * 300 + b"]" * 300)
            + b"}"
        )
        deep = httpx.post(
            gateway.url + "/v1/chat/completions", content=nested, timeout=PATIENCE_SECONDS
        )
        assert deep.status_code == 400 and deep.json()["error"]["code"] == "too_deep"
        many = b'{"model":"m","prompt":[' + b",".join([b"[1]"] * 300_000) + b"]}"
        wide = httpx.post(gateway.url + "/v1/completions", content=many, timeout=PATIENCE_SECONDS)
        assert wide.status_code == 400 and wide.json()["error"]["code"] == "too_many_values"
        assert ask(gateway.url).status_code == 200


def test_the_last_replica_refusing_connections_is_an_openai_503() -> None:
    with EmulatedReplicas(1, MODEL) as replica, GatewayProcess(replica.urls) as gateway:
        assert ask(gateway.url).status_code == 200
        replica.replicas[0].kill()
        answers = [ask(gateway.url) for _ in range(3)]
        for answer in answers:
            assert answer.status_code in (502, 503)
            error = answer.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert "127.0.0.1" not in answer.text
        assert answers[-1].status_code == 503


def test_removed_backends_leave_the_metrics(fleet: EmulatedReplicas) -> None:
    with GatewayProcess(fleet.urls) as gateway:
        for turn in range(6):
            assert ask(gateway.url, f"warm {turn}").status_code == 200
        gone = fleet.urls[0].removeprefix("http://")
        assert f'backend="{gone}"' in gateway.metrics()
        assert (
            httpx.delete(
                gateway.url + f"/admin/backends/{gone}", timeout=PATIENCE_SECONDS
            ).status_code
            == 200
        )
        assert f'backend="{gone}"' not in gateway.metrics()
        assert ask(gateway.url).status_code == 200


def test_tenants_neither_hit_nor_probe_each_others_prefixes(fleet: EmulatedReplicas) -> None:
    with GatewayProcess(
        fleet.urls, "--api-key", "tenant-a", "--api-key", "tenant-b", "--isolate-tenants"
    ) as gateway:
        system = " ".join(f"s{index}" for index in range(400))
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "q"}]

        def ask(key: str) -> openai.types.CompletionUsage:
            client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)
            usage = client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=2,  # type: ignore[arg-type]
            ).usage
            assert usage is not None
            return usage

        first_a = ask("tenant-a")
        second_a = ask("tenant-a")
        first_b = ask("tenant-b")
        cached = [
            (usage.prompt_tokens_details.cached_tokens or 0) if usage.prompt_tokens_details else 0
            for usage in (first_a, second_a, first_b)
        ]
        assert cached[0] == 0 and cached[1] > 0  # a tenant hits its own cache
        assert cached[2] == 0  # and never another's, even on the same replica


def test_a_tenants_stored_responses_are_its_own(fleet: EmulatedReplicas) -> None:
    with GatewayProcess(
        fleet.urls, "--api-key", "tenant-a", "--api-key", "tenant-b", "--isolate-tenants"
    ) as gateway:
        as_a = openai.OpenAI(base_url=gateway.url + "/v1", api_key="tenant-a", max_retries=0)
        as_b = openai.OpenAI(base_url=gateway.url + "/v1", api_key="tenant-b", max_retries=0)
        stored = as_a.responses.create(model=MODEL, input="a secret", max_output_tokens=2)
        assert as_a.responses.retrieve(stored.id).id == stored.id
        with pytest.raises(openai.NotFoundError):
            as_b.responses.retrieve(stored.id)
        with pytest.raises(openai.NotFoundError):
            as_b.responses.create(
                model=MODEL, input="more", previous_response_id=stored.id, max_output_tokens=2
            )
        # The engines' endpoints outside /v1/ need a key as well.
        body = {"model": MODEL, "prompt": "x"}
        assert (
            httpx.post(gateway.url + "/tokenize", json=body, timeout=PATIENCE_SECONDS).status_code
            == 401
        )
        keyed = {"authorization": "Bearer tenant-b"}
        assert (
            httpx.post(
                gateway.url + "/tokenize", json=body, headers=keyed, timeout=PATIENCE_SECONDS
            ).status_code
            == 200
        )


def test_tenant_isolation_needs_client_keys() -> None:
    with pytest.raises(ConfigError):
        Settings(backend=("x:1",), isolate_tenants=True).validate()
    dataclasses.replace(Settings(backend=("x:1",)), isolate_tenants=True, api_key=("k",)).validate()
