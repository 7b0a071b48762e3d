"""Every way a request's life can end gives back what it took, once: answered; its client gone
while it waited in the queue, before its first byte, in the middle of its stream, at `[DONE]`;
an upstream error and a retry on another replica; an exception inside forwarding; a queue
timeout; a full queue; the gateway shutting down while it drains. After each, every lease gauge
is back at zero, the tenant was charged by the rules of docs/tenants.md, and the index holds
nothing of a placement that never reached its replica.

Real processes on loopback: emulated replicas (held before their first token, or between two,
with the emulator's stall), a replica of the test's own that answers 500, and gateways under
flow control with one slot per replica, so that what waits where is the test's to arrange.
Clients are raw sockets where the test must hang up at a chosen moment.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import signal
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, MutableMapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from prefix_gateway.app import GatewayApp
from prefix_gateway.config import load_settings
from prefix_gateway.emulator.replicas import EmulatedReplicas
from prefix_gateway.processes import metric_value
from tests.fault_servers import FaultServer
from tests.support import GatewayProcess, stall, wait_until

MODEL = "life-model"
KEY = "team-key"
TENANTS = [{"name": "team", "api_key": KEY, "tokens_per_minute": 10_000_000}]
LEASES = (
    "gateway_requests_admitted",
    "gateway_requests_waiting",
    "gateway_request_body_bytes_held",
    "gateway_placements_open",
    "gateway_backend_in_flight",
    "gateway_tenant_in_flight",
    "gateway_tenant_reserved_tokens",
)
# Replicas held by the test, and a stall watch that must not take them out for it.
HELD = ("--stall-seconds", "3600", "--queue-timeout", "300")


def held(gateway: GatewayProcess) -> dict[str, float]:
    """The leases still held, by gauge: empty once everything was given back."""
    text = gateway.metrics_text()
    values = {name: metric_value(text, name) for name in LEASES}
    return {name: value for name, value in values.items() if value}


def given_back(gateway: GatewayProcess) -> None:
    wait_until(lambda: not held(gateway), "every lease given back")


def tokens(gateway: GatewayProcess) -> dict[str, int]:
    """The tokens the tenant was charged for, by kind."""
    listed = httpx.get(gateway.url + "/admin/tenants", timeout=10).json()["data"]
    found: dict[str, int] = listed[0]["tokens"]
    return found


def reached(replicas: EmulatedReplicas) -> int:
    """Requests the replicas finished, however (answered, or aborted when the client left)."""
    return round(
        sum(
            metric_value(httpx.get(url + "/metrics", timeout=10).text, "vllm:request_success_total")
            for url in replicas.urls
        )
    )


def chat(text: str, max_tokens: int, stream: bool = True) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


class RawClient:
    """One request on a socket of its own, read as far as the test wants, then hung up."""

    def __init__(self, gateway: GatewayProcess, body: dict[str, Any], key: str = KEY) -> None:
        data = json.dumps(body).encode()
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: {gateway.host}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(data)}\r\n"
            f"authorization: Bearer {key}\r\n\r\n"
        )
        self.sock = socket.create_connection((gateway.host, gateway.port), timeout=60)
        self.received = b""
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.sock.sendall(head.encode() + data)  # a body refused unread is cut short

    def read_until(self, marker: bytes, count: int = 1) -> bytes:
        """Read until `marker` has come `count` times."""
        while self.received.count(marker) < count:
            chunk = self.sock.recv(65536)
            assert chunk, f"the connection closed before {marker!r}: {self.received!r}"
            self.received += chunk
        return self.received

    def read_to_end(self) -> bytes:
        """Read the answer to its end, and close."""
        with self.sock, contextlib.suppress(ConnectionResetError):
            while chunk := self.sock.recv(65536):
                self.received += chunk
                if self.received.endswith(b"0\r\n\r\n"):
                    break
        return self.received

    def hang_up(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def replicas() -> Iterator[EmulatedReplicas]:
    with EmulatedReplicas(2, MODEL, ["--decode-ms-per-token", "40"]) as started:
        yield started


def start_gateway(
    stack: ExitStack, tmp_path: Path, backends: list[str], *args: str
) -> GatewayProcess:
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({"tenants": TENANTS}))
    specs = [f"{MODEL}={url}" for url in backends]
    return stack.enter_context(GatewayProcess(specs, "--config", str(config), *HELD, *args))


@pytest.fixture(scope="module")
def gateway(
    replicas: EmulatedReplicas, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    with ExitStack() as stack:
        yield start_gateway(
            stack,
            tmp_path_factory.mktemp("life"),
            replicas.urls,
            *("--max-inflight-per-replica", "1", "--max-queue", "1"),
        )


@pytest.fixture
def stalled(replicas: EmulatedReplicas) -> Iterator[EmulatedReplicas]:
    """The replicas hold every token until the test (or its end) lets them go."""
    for replica in replicas.replicas:
        stall(replica, True)
    try:
        yield replicas
    finally:
        for replica in replicas.replicas:
            stall(replica, False)


def fill_the_slots(gateway: GatewayProcess, stalled: EmulatedReplicas) -> list[RawClient]:
    """One held stream on each replica: every slot taken."""
    holders = [RawClient(gateway, chat(f"holder {n}", 4)) for n in range(2)]
    wait_until(
        lambda: gateway.metric("gateway_backend_in_flight") == 2, "both replicas' slots taken"
    )
    return holders


def refused_at_once(gateway: GatewayProcess, text: str) -> str:
    """The error code of a request the gateway refuses without reaching a replica."""
    answer = httpx.post(
        gateway.url + "/v1/chat/completions",
        json=chat(text, 4, stream=False),
        headers={"authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert answer.status_code == 429, answer.text
    code: str = answer.json()["error"]["code"]
    return code


def let_go(stalled: EmulatedReplicas, clients: Iterable[RawClient]) -> None:
    """The replicas let go; every client's stream read to its end."""
    for replica in stalled.replicas:
        stall(replica, False)
    for client in clients:
        assert b"[DONE]" in client.read_to_end()


def test_an_answered_request_gives_everything_back_and_is_charged_what_it_used(
    gateway: GatewayProcess,
) -> None:
    before = tokens(gateway)
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0) as client:
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "a short answer"}],
                max_tokens=6,
                stream=True,
            )
        )
        whole = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "and a whole one"}], max_tokens=5
        )
    # The gateway asked for the stream's usage to charge it, and kept it from the client.
    assert chunks and all(chunk.usage is None for chunk in chunks)
    assert whole.usage is not None and whole.usage.completion_tokens == 5
    given_back(gateway)
    after = tokens(gateway)
    assert after["completion"] - before["completion"] == 6 + 5
    assert after["prompt"] > before["prompt"]


def test_a_client_gone_while_queued_leaves_the_queue_and_reaches_no_replica(
    gateway: GatewayProcess, stalled: EmulatedReplicas
) -> None:
    before, arrived = tokens(gateway), reached(stalled)
    holders = fill_the_slots(gateway, stalled)
    queued = RawClient(gateway, chat("queued, then gone", 4))
    wait_until(lambda: gateway.metric("gateway_requests_waiting", queue="flow") == 1, "one waiting")
    queued.hang_up()
    wait_until(
        lambda: gateway.metric("gateway_requests_waiting", queue="flow") == 0,
        "the queue left at once",
    )
    let_go(stalled, holders)
    given_back(gateway)
    wait_until(lambda: reached(stalled) == arrived + 2, "the two holders finished")
    assert tokens(gateway)["completion"] - before["completion"] == 4 + 4


def test_a_client_gone_before_the_first_byte_is_charged_nothing(
    gateway: GatewayProcess, stalled: EmulatedReplicas
) -> None:
    before, arrived = tokens(gateway), reached(stalled)
    client = RawClient(gateway, chat("gone before a token", 4))
    wait_until(lambda: gateway.metric("gateway_backend_in_flight") == 1, "at its replica")
    client.hang_up()
    given_back(gateway)
    # The replica saw its client leave: the request was aborted there, not answered.
    wait_until(lambda: reached(stalled) == arrived + 1, "aborted at the replica")
    assert tokens(gateway) == before


def test_a_stream_cut_mid_way_is_charged_its_prompt_and_the_tokens_relayed(
    gateway: GatewayProcess,
) -> None:
    before = tokens(gateway)
    client = RawClient(gateway, chat("a long answer, cut", 400))
    client.read_until(b'"content"', 3)
    client.hang_up()
    given_back(gateway)
    after = tokens(gateway)
    relayed = after["completion"] - before["completion"]
    assert 3 <= relayed < 400, relayed
    assert after["prompt"] > before["prompt"]


def test_a_client_gone_at_done_is_charged_in_full(gateway: GatewayProcess) -> None:
    before = tokens(gateway)
    client = RawClient(gateway, chat("read to its end", 7))
    client.read_until(b"[DONE]")
    client.hang_up()
    given_back(gateway)
    assert tokens(gateway)["completion"] - before["completion"] == 7


def test_a_full_queue_refuses_and_a_refusal_costs_nothing(
    gateway: GatewayProcess, stalled: EmulatedReplicas
) -> None:
    before = tokens(gateway)
    holders = fill_the_slots(gateway, stalled)
    waiting = RawClient(gateway, chat("waits", 4))
    wait_until(lambda: gateway.metric("gateway_requests_waiting", queue="flow") == 1, "one waiting")
    assert refused_at_once(gateway, "one too many") == "overloaded"
    let_go(stalled, (*holders, waiting))
    given_back(gateway)
    assert tokens(gateway)["completion"] - before["completion"] == 3 * 4


def test_a_queue_timeout_gives_back_its_place_and_its_reservation(
    replicas: EmulatedReplicas, stalled: EmulatedReplicas, tmp_path: Path
) -> None:
    with ExitStack() as stack:
        # Its own gateway: a queue timeout of 1 s (given last, it wins over HELD's).
        gateway = start_gateway(
            stack,
            tmp_path,
            replicas.urls,
            *("--max-inflight-per-replica", "1", "--queue-timeout", "1"),
        )
        before = tokens(gateway)
        holders = fill_the_slots(gateway, stalled)
        assert refused_at_once(gateway, "too late") == "queue_timeout"
        let_go(stalled, holders)
        given_back(gateway)
        assert tokens(gateway)["completion"] - before["completion"] == 2 * 4


def test_an_upstream_error_and_a_retry_elsewhere_give_back_both_slots(
    replicas: EmulatedReplicas, tmp_path: Path
) -> None:
    with ExitStack() as stack:
        failing = stack.enter_context(FaultServer(mode="status", status=503))
        gateway = start_gateway(
            stack, tmp_path, [failing.url, replicas.urls[0]], "--max-inflight-per-replica", "1"
        )
        headers = {"authorization": f"Bearer {KEY}"}
        url = gateway.url + "/v1/chat/completions"
        bodies = [chat(f"retried elsewhere {n} " + "words " * 40, 3, False) for n in range(8)]
        for body in bodies:
            assert httpx.post(url, json=body, headers=headers, timeout=60).status_code == 200
        assert failing.posts > 0 and gateway.metric("gateway_upstream_retries_total") > 0
        given_back(gateway)
        # What the placements recorded at the failing replica was withdrawn: it took nothing.
        for body in bodies:
            explained = httpx.post(gateway.url + "/admin/explain", json=body, timeout=10).json()
            at = {row["backend"]: row["matched_blocks"] for row in explained["candidates"]}
            assert at[failing.url.removeprefix("http://")] == 0, at


def test_a_placement_that_never_reached_its_replica_is_withdrawn_from_the_index(
    replicas: EmulatedReplicas, stalled: EmulatedReplicas, tmp_path: Path
) -> None:
    """A stream waits for the prefill of an earlier one computing its prefix on its replica
    (`--prefill-wait`); its client leaves meanwhile: it was placed, never sent."""
    with ExitStack() as stack:
        gateway = start_gateway(stack, tmp_path, replicas.urls, "--prefill-wait", "600")
        shared = "a long shared beginning " * 40
        first = RawClient(gateway, chat(shared, 4))
        wait_until(lambda: gateway.metric("gateway_backend_in_flight") == 1, "the first sent")
        body = {
            **chat(shared, 4),
            "messages": [
                {"role": "user", "content": shared},
                {"role": "assistant", "content": "an answer"},
                {"role": "user", "content": "and a follow-up " * 40},
            ],
        }
        explain = gateway.url + "/admin/explain"
        depth_before = httpx.post(explain, json=body, timeout=10).json()["matched_tokens"]
        second = RawClient(gateway, body)
        wait_until(lambda: gateway.metric("gateway_placements_open") == 2, "the second placed")
        assert gateway.metric("gateway_backend_in_flight") == 2  # its slot, not yet sent
        second.hang_up()
        wait_until(lambda: gateway.metric("gateway_placements_open") == 1, "the second settled")
        assert httpx.post(explain, json=body, timeout=10).json()["matched_tokens"] == depth_before
        for replica in stalled.replicas:
            stall(replica, False)
        first.read_to_end()
        given_back(gateway)


@contextlib.asynccontextmanager
async def served_in_process(replica: str) -> AsyncIterator[GatewayApp]:
    """The gateway's ASGI app started in this process (its lifespan run by hand) in front of
    `replica`, once the replica is healthy; shut down on leaving."""
    settings = load_settings(
        environ={
            "GATEWAY_BACKENDS": f"{MODEL}={replica}",
            "GATEWAY_MAX_INFLIGHT_PER_REPLICA": "1",
            "GATEWAY_DOCTOR_INTERVAL": "0",
        }
    )
    app = GatewayApp(settings)
    startup = asyncio.Queue[dict[str, Any]]()
    await startup.put({"type": "lifespan.startup"})
    sent: list[MutableMapping[str, Any]] = []

    async def lifespan_send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    lifespan = asyncio.create_task(app({"type": "lifespan"}, startup.get, lifespan_send))
    while not sent:
        await asyncio.sleep(0.01)
    assert sent[0]["type"] == "lifespan.startup.complete", sent
    components = app.components
    assert components is not None
    while not components.pool.backends[0].healthy:
        await asyncio.sleep(0.05)
    try:
        yield app
    finally:
        await startup.put({"type": "lifespan.shutdown"})
        await lifespan


def chat_scope() -> dict[str, Any]:
    return {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [(b"content-type", b"application/json")],
        "query_string": b"",
        "client": ("127.0.0.1", 9),
        "server": ("127.0.0.1", 8080),
        "scheme": "http",
    }


def receiving(body: bytes) -> Callable[[], Awaitable[dict[str, Any]]]:
    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


def test_an_exception_inside_forwarding_ends_the_request_and_gives_everything_back(
    replicas: EmulatedReplicas,
) -> None:
    """The ASGI server's `send` fails as the answer goes out (a server-side fault): the
    exception leaves the forwarding; the request still ends cleanly."""

    async def scenario() -> tuple[list[int], dict[str, int]]:
        async with served_in_process(replicas.urls[0]) as app:
            body = json.dumps(chat("an answer nobody can be sent", 3, stream=False)).encode()
            statuses: list[int] = []

            async def broken_send(message: MutableMapping[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    statuses.append(message["status"])
                else:
                    raise ConnectionResetError("the server lost the connection")

            await app(chat_scope(), receiving(body), broken_send)
            components = app.components
            assert components is not None
            proxy = components.proxy
            left = {
                "admitted": proxy.admission.active,
                "body_bytes": proxy.bodies.held,
                "placements": proxy.open_placements,
                "in_flight": sum(backend.in_flight for backend in components.pool.backends),
                "waiting": 0 if proxy.flow is None else proxy.flow.waiting,
            }
        return statuses, left

    statuses, left = asyncio.run(scenario())
    assert statuses == [200]  # the replica answered; the server could not pass it on
    assert left == dict.fromkeys(left, 0)


def test_an_ended_request_leaves_nothing_for_the_garbage_collector(
    replicas: EmulatedReplicas,
) -> None:
    """Answered, streamed and refused, a request's objects are freed when it ends: none of
    them is held in a reference cycle, which only the collector would find (and whose
    walks, when every request left one, took a tenth of the gateway's CPU)."""

    async def scenario() -> tuple[list[int], list[str]]:
        async with served_in_process(replicas.urls[0]) as app:
            statuses: list[int] = []

            async def send(message: MutableMapping[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    statuses.append(message["status"])

            bodies = [
                json.dumps(chat("an answer in one piece", 3, stream=False)).encode(),
                json.dumps(chat("an answer in events", 3, stream=True)).encode(),
                b"{not json",
            ]
            gc.collect()
            gc.set_debug(gc.DEBUG_SAVEALL)
            try:
                for body in bodies:
                    await app(chat_scope(), receiving(body), send)
                gc.collect()
                cyclic = {
                    type(thing).__module__ + "." + type(thing).__qualname__ for thing in gc.garbage
                }
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
        return statuses, sorted(kind for kind in cyclic if kind.startswith("prefix_gateway."))

    statuses, cyclic = asyncio.run(scenario())
    assert statuses == [200, 200, 400]
    assert cyclic == [], cyclic


def test_a_shutdown_while_draining_ends_every_request_and_leaves_nothing_held(
    replicas: EmulatedReplicas, stalled: EmulatedReplicas, tmp_path: Path
) -> None:
    with ExitStack() as stack:
        gateway = start_gateway(
            stack,
            tmp_path,
            replicas.urls,
            *("--max-inflight-per-replica", "1", "--shutdown-grace", "30"),
        )
        holders = fill_the_slots(gateway, stalled)
        queued = RawClient(gateway, chat("queued at shutdown", 4))
        wait_until(
            lambda: gateway.metric("gateway_requests_waiting", queue="flow") == 1, "one waiting"
        )
        os.kill(gateway.pid, signal.SIGTERM)
        wait_until(lambda: "shutting down" in gateway.log(), "the shutdown begun")
        for replica in stalled.replicas:
            stall(replica, False)
        for holder in holders:
            assert b"[DONE]" in holder.read_to_end()
        answer = queued.read_to_end()
        wait_until(lambda: not gateway.running, "the gateway ended", seconds=120)
        assert gateway.stop() == 128 + signal.SIGTERM  # its own exit on SIGTERM, after draining
    # Served once a slot freed during the drain, or refused when the grace ran out.
    assert b"[DONE]" in answer or b"shutting_down" in answer, answer
    assert "still held" not in gateway.log()


def peak_rss_reset(pid: int) -> None:
    """Start measuring the process's peak resident memory anew (VmHWM)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def test_queued_bodies_count_against_the_body_limit_and_memory_stays_bounded(
    replicas: EmulatedReplicas, stalled: EmulatedReplicas, tmp_path: Path
) -> None:
    """Sixty bodies of 1 MiB while every slot is taken: those past `--max-pending-body-bytes`
    (4 MiB) are refused before they are read, the rest wait counted, and the gateway's peak
    memory grows by a few times the limit, not by the sixty bodies."""
    limit = 4 * 2**20
    with ExitStack() as stack:
        gateway = start_gateway(
            stack,
            tmp_path,
            replicas.urls,
            *("--max-inflight-per-replica", "1", "--max-pending-body-bytes", str(limit)),
            *("--max-body-bytes", str(2 * 2**20)),
        )
        holders = fill_the_slots(gateway, stalled)
        peak_rss_reset(gateway.pid)
        before = peak_rss_mib(gateway.pid)
        text = "x" * (2**20 - 200)
        clients = [RawClient(gateway, chat(f"{n} {text}", 4)) for n in range(60)]

        def refused() -> float:
            return gateway.metric("gateway_rejected_requests_total", code="pending_bodies")

        wait_until(
            lambda: refused() + gateway.metric("gateway_requests_waiting", queue="flow") == 60,
            "every body queued or refused",
        )
        held_bytes = gateway.metric("gateway_request_body_bytes_held")
        grown = peak_rss_mib(gateway.pid) - before
        for replica in stalled.replicas:
            stall(replica, False)
        answers = [client.read_to_end() for client in (*holders, *clients)]
        given_back(gateway)
        turned_away = refused()
    # Those queued reached a replica (which finds a prompt of 1 MiB past its context: a 400).
    reached_replica = sum(answer.startswith(b"HTTP/1.1 400") for answer in answers[2:])
    assert reached_replica == 60 - turned_away and turned_away >= 56, (
        reached_replica,
        turned_away,
    )
    assert held_bytes <= limit
    assert grown < 64, f"peak memory grew by {grown:.0f} MiB"
