"""Every refusal the gateway gives, against a real gateway on a loopback port: its status, the
OpenAI error body with its type and code, the headers `prefix_gateway/refusals.py` gives it, and the
rejection metric gone up by exactly the refusals answered, under that status and code and no
other.

One gateway (module fixture) takes the emulated replicas, a fault server that can be made to
stall (its model times out before the first byte), one that cuts its streams short and one
that is stopped before it is asked (its model's replica cannot be reached); its limits are
small so that each refusal plays out in seconds. A refusal is provoked with raw sockets where
the HTTP client would not send it.
"""

from __future__ import annotations

import select
import socket
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefix_gateway.emulator.replicas import EmulatedReplicas
from prefix_gateway.errors import GatewayError
from prefix_gateway.proxy.deadlines import Why, client_error
from prefix_gateway.refusals import REFUSALS, headers_of, refused
from tests.conftest import MODEL
from tests.fault_servers import FaultServer
from tests.support import GatewayProcess, read_to_close, wait_until

KEY = "client-key"
STALLING = "stalling-model"
GONE = "gone-model"
CUTTING = "cutting-model"
MAX_HEADER_BYTES = 8192
MAX_HEADERS = 40
MAX_BODY = 100_000
MAX_PENDING = 250_000
MAX_CONNECTIONS = 6
TIMEOUTS = ("--head-timeout", "2", "--body-timeout", "2", "--first-byte-timeout", "4")
"""The first byte outwaits a queue's timeout: a stalled request holds the only slot meanwhile."""

Rejections = Counter[tuple[str, str]]


@pytest.fixture(scope="module")
def stalling() -> Iterator[FaultServer]:
    with FaultServer() as server:
        yield server


@pytest.fixture(scope="module")
def cutting() -> Iterator[FaultServer]:
    with FaultServer(mode="cut") as server:
        yield server


@pytest.fixture(scope="module")
def edge(
    fleet: EmulatedReplicas, stalling: FaultServer, cutting: FaultServer
) -> Iterator[GatewayProcess]:
    gone = FaultServer().start()  # stopped once the gateway has admitted it
    args = [f"{STALLING}={stalling.url}", f"{GONE}={gone.url}", f"{CUTTING}={cutting.url}"]
    limits = ["--api-key", KEY, *TIMEOUTS, "--max-attempts", "1", "--stall-seconds", "60"]
    limits += ["--max-header-bytes", str(MAX_HEADER_BYTES), "--max-headers", str(MAX_HEADERS)]
    limits += ["--max-body-bytes", str(MAX_BODY), "--max-pending-body-bytes", str(MAX_PENDING)]
    limits += ["--max-connections", str(MAX_CONNECTIONS)]
    limits += ["--max-concurrency", "1", "--max-queue", "1", "--queue-timeout", "1"]
    # One probe at start admits every replica; none later would see the stopped one go.
    limits += ["--health-interval", "60"]
    with GatewayProcess([*fleet.urls, *args], *limits) as gateway:
        gone.stop()
        yield gateway


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    @classmethod
    def of(cls, response: httpx.Response) -> Answer:
        return cls(response.status_code, dict(response.headers), response.content)

    @classmethod
    def parse(cls, raw: bytes) -> Answer:
        head, _, body = raw.partition(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        return cls(int(status_line.split()[1]), headers, body)


def rejections(gateway: GatewayProcess) -> Rejections:
    counted: Rejections = Counter()
    for family in text_string_to_metric_families(gateway.metrics()):
        if family.name == "gateway_rejected_requests":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    labels = sample.labels
                    counted[labels["status"], labels["code"]] = int(sample.value)
    return counted


def refused_with(
    gateway: GatewayProcess, provoke: Callable[[], list[Answer]]
) -> tuple[list[Answer], Rejections]:
    """What `provoke` was answered, and how the rejection metric moved meanwhile."""
    before = rejections(gateway)
    answers = provoke()
    after = rejections(gateway)
    moved = Counter({key: after[key] - before[key] for key in after if after[key] != before[key]})
    return answers, moved


def check(
    answer: Answer, status: int, error_type: str, code: str, headers: dict[str, str] | None = None
) -> None:
    assert answer.status == status, answer
    assert answer.headers["content-type"] == "application/json"
    error = orjson.loads(answer.body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == (error_type, code)
    assert isinstance(error["message"], str) and error["message"]
    for name, value in (headers or {}).items():
        assert answer.headers.get(name) == value, (name, answer.headers)


def post(gateway: GatewayProcess, body: bytes, *, key: str | None = KEY, **extra: str) -> Answer:
    headers = {"content-type": "application/json", **extra}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    url = gateway.url + "/v1/chat/completions"
    return Answer.of(httpx.post(url, content=body, headers=headers, timeout=30))


def chat(model: str = MODEL, content: str = "hello") -> bytes:
    message = {"role": "user", "content": content}
    return orjson.dumps({"model": model, "messages": [message], "max_tokens": 2})


def connect(gateway: GatewayProcess) -> socket.socket:
    raw = socket.create_connection(("127.0.0.1", gateway.port))
    raw.settimeout(30)
    return raw


def raw_answer(gateway: GatewayProcess, sent: bytes) -> Answer:
    with connect(gateway) as raw:
        raw.sendall(sent)
        return Answer.parse(read_to_close(raw))


def head(length: int | None = None, extra: bytes = b"") -> bytes:
    lines = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    lines += f"authorization: Bearer {KEY}\r\n".encode()
    if length is not None:
        lines += b"content-length: %d\r\n" % length
    return lines + extra + b"\r\n"


CLOSE = {"connection": "close"}
RETRY = {"retry-after": "1"}


def test_every_refusal_in_the_table_renders_with_its_code() -> None:
    for code, refusal in REFUSALS.items():
        error = refused(code, 3, "x")
        assert isinstance(error, refusal.kind) and error.code == code
        assert orjson.loads(error.body())["error"]["code"] == code
        assert set(refusal.headers) <= set(headers_of(error))


def test_every_interruption_but_the_clients_own_is_answered() -> None:
    """The shutdown's refusal is checked here: provoking it needs a server's grace to end."""
    gone = {Why.DISCONNECTED, Why.CLIENT_STALLED}
    for why in Why:
        error = client_error(why, 2.0)
        assert (error is None) == (why in gone)
        assert error is None or error.code in REFUSALS
    ending = client_error(None)
    assert isinstance(ending, GatewayError) and (ending.status, ending.code) == (
        503,
        "shutting_down",
    )


# --- in front of the proxy: the request's head, the key, the method, loops ----------------


def test_bad_json_and_bad_fields_are_400(edge: GatewayProcess) -> None:
    answers, moved = refused_with(
        edge, lambda: [post(edge, b"{not json"), post(edge, b'{"model": 7, "messages": []}')]
    )
    check(answers[0], 400, "invalid_request_error", "invalid_json")
    check(answers[1], 400, "invalid_request_error", "invalid_type")
    assert moved == {("400", "invalid_json"): 1, ("400", "invalid_type"): 1}


def test_a_missing_key_is_401_with_a_challenge(edge: GatewayProcess) -> None:
    answers, moved = refused_with(edge, lambda: [post(edge, chat(), key=None)])
    challenge = {"www-authenticate": "Bearer"}
    check(answers[0], 401, "authentication_error", "missing_api_key", challenge)
    assert moved == {("401", "missing_api_key"): 1}


def test_an_unknown_model_is_404(edge: GatewayProcess) -> None:
    answers, moved = refused_with(edge, lambda: [post(edge, chat("no-such-model"))])
    check(answers[0], 404, "invalid_request_error", "model_not_found")
    assert moved == {("404", "model_not_found"): 1}


def test_a_wrong_method_is_405_with_allow(edge: GatewayProcess) -> None:
    def provoke() -> list[Answer]:
        headers = {"authorization": f"Bearer {KEY}"}
        url = edge.url + "/v1/chat/completions"
        return [Answer.of(httpx.get(url, headers=headers, timeout=30))]

    answers, moved = refused_with(edge, provoke)
    check(answers[0], 405, "invalid_request_error", "http_405", {"allow": "POST"})
    assert moved == {("405", "http_405"): 1}


def test_a_request_that_passed_through_once_is_508(edge: GatewayProcess) -> None:
    answers, moved = refused_with(edge, lambda: [post(edge, chat(), via="1.1 prefix-gateway")])
    check(answers[0], 508, "invalid_request_error", "loop_detected")
    assert moved == {("508", "loop_detected"): 1}


def test_heads_too_large_or_with_too_many_lines_are_431(edge: GatewayProcess) -> None:
    padding = b"x-padding: " + b"p" * MAX_HEADER_BYTES + b"\r\n"
    lines = b"".join(b"x-line-%d: v\r\n" % number for number in range(MAX_HEADERS + 1))
    answers, moved = refused_with(
        edge, lambda: [raw_answer(edge, head(0, padding)), raw_answer(edge, head(0, lines))]
    )
    check(answers[0], 431, "invalid_request_error", "headers_too_large", CLOSE)
    check(answers[1], 431, "invalid_request_error", "too_many_headers", CLOSE)
    assert moved == {("431", "headers_too_large"): 1, ("431", "too_many_headers"): 1}


def test_a_head_that_never_ends_is_408(edge: GatewayProcess) -> None:
    answers, moved = refused_with(edge, lambda: [raw_answer(edge, b"POST /v1/chat/comp")])
    check(answers[0], 408, "invalid_request_error", "head_timeout", CLOSE)
    assert moved == {("408", "head_timeout"): 1}


def test_connections_past_the_cap_are_503(edge: GatewayProcess) -> None:
    def provoke() -> list[Answer]:
        held = [connect(edge) for _ in range(MAX_CONNECTIONS)]
        try:
            with connect(edge) as extra:
                return [Answer.parse(read_to_close(extra))]
        finally:
            for raw in held:
                raw.close()  # before their head timeout: nothing was sent, nothing answered

    answers, moved = refused_with(edge, provoke)
    check(answers[0], 503, "service_unavailable", "too_many_connections", CLOSE | RETRY)
    assert moved == {("503", "too_many_connections"): 1}


# --- the body -------------------------------------------------------------------------------


def test_a_body_declared_too_large_is_413(edge: GatewayProcess) -> None:
    answers, moved = refused_with(edge, lambda: [raw_answer(edge, head(MAX_BODY + 1))])
    check(answers[0], 413, "invalid_request_error", "body_too_large", CLOSE)
    assert moved == {("413", "body_too_large"): 1}


def test_bodies_past_the_pending_budget_are_429_and_stalled_ones_408(
    edge: GatewayProcess,
) -> None:
    """Two bodies of 90 kB stall; a third declaring 100 kB is refused once both are held
    (one sent before they were may itself stall, and is counted with them)."""
    stalled: list[socket.socket] = []

    def provoke() -> list[Answer]:
        for _ in range(2):
            raw = connect(edge)
            raw.sendall(head(MAX_BODY) + b" " * 90_000)
            stalled.append(raw)
        refused = None
        while refused is None and len(stalled) < MAX_CONNECTIONS - 1:
            probe = connect(edge)
            probe.sendall(head(MAX_BODY))
            if select.select([probe], [], [], 1.0)[0]:
                refused = Answer.parse(read_to_close(probe))
                probe.close()
            else:
                stalled.append(probe)  # the budget was not yet taken: it is one more body
        assert refused is not None
        timed_out = [Answer.parse(read_to_close(raw)) for raw in stalled]
        for raw in stalled:
            raw.close()
        return [refused, *timed_out]

    answers, moved = refused_with(edge, provoke)
    check(answers[0], 429, "rate_limit_error", "pending_bodies", CLOSE | RETRY)
    for answer in answers[1:]:
        check(answer, 408, "invalid_request_error", "body_timeout", CLOSE)
    assert moved == {("429", "pending_bodies"): 1, ("408", "body_timeout"): len(stalled)}


# --- admission and the replicas ---------------------------------------------------------------


def test_a_stalled_replica_holds_the_slot_then_is_a_504(
    edge: GatewayProcess, stalling: FaultServer
) -> None:
    """The stalled request holds the only slot: of two sent meanwhile one waits out the queue's
    timeout and one finds the queue full; then the stalled one misses its first byte."""
    answers: list[Answer] = []

    def ask(body: bytes) -> None:
        answers.append(post(edge, body))

    def provoke() -> list[Answer]:
        stalled_before = stalling.stalled
        stalling.mode = "stall"
        try:
            holder = threading.Thread(target=ask, args=(chat(STALLING),))
            holder.start()
            wait_until(
                lambda: stalling.stalled == stalled_before + 1, "the stalled request holds the slot"
            )
            waiting = [threading.Thread(target=ask, args=(chat(),)) for _ in range(2)]
            for thread in waiting:
                thread.start()
            for thread in [*waiting, holder]:
                thread.join(60)
        finally:
            stalling.mode = "ok"
        return answers

    replies, moved = refused_with(edge, provoke)
    assert len(replies) == 3
    by_code = {orjson.loads(reply.body)["error"]["code"]: reply for reply in replies}
    check(by_code["overloaded"], 429, "rate_limit_error", "overloaded", RETRY)
    check(by_code["queue_timeout"], 429, "rate_limit_error", "queue_timeout", RETRY)
    check(by_code["first_byte_timeout"], 504, "upstream_timeout", "first_byte_timeout")
    assert moved == {
        ("429", "overloaded"): 1,
        ("429", "queue_timeout"): 1,
        ("504", "first_byte_timeout"): 1,
    }


def test_an_unreachable_replica_is_no_healthy_backend_503_every_time(edge: GatewayProcess) -> None:
    answers, moved = refused_with(edge, lambda: [post(edge, chat(GONE)), post(edge, chat(GONE))])
    # The refused connection ejects the only replica at once: the next request has none. Both
    # clients are told the same: nothing could take the request, try again shortly.
    check(answers[0], 503, "service_unavailable", "no_healthy_backend", RETRY)
    check(answers[1], 503, "service_unavailable", "no_healthy_backend", RETRY)
    assert moved == {("503", "no_healthy_backend"): 2}


def test_a_stream_cut_after_its_first_byte_ends_with_a_counted_error_event(
    edge: GatewayProcess,
) -> None:
    def provoke() -> list[Answer]:
        body = orjson.loads(chat(CUTTING))
        return [post(edge, orjson.dumps({**body, "stream": True}))]

    answers, moved = refused_with(edge, provoke)
    assert answers[0].status == 200  # the stream had begun: the error is its last event
    last = answers[0].body.strip().rsplit(b"\n\n", 1)[-1]
    assert last.startswith(b"data: ")
    error = orjson.loads(last.removeprefix(b"data: "))["error"]
    assert (error["type"], error["code"]) == ("upstream_error", "stream_broken")
    assert moved == {("502", "stream_broken"): 1}


def test_an_answer_still_serves_after_the_sweep(edge: GatewayProcess) -> None:
    answer = post(edge, chat())
    assert answer.status == 200, answer
