"""The fleet admin API against a real gateway and emulated replicas on loopback."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest

from prefix_gateway.emulator.replicas import EmulatedReplicas
from tests.support import PATIENCE_SECONDS, GatewayProcess, wait_until

MODEL = "emulated-model"
TOKEN = "fleet-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def replicas() -> Iterator[EmulatedReplicas]:
    # Slow decoding, so that a streamed answer is still running while its replica drains.
    with EmulatedReplicas(3, MODEL, ["--decode-ms-per-token", "25"]) as started:
        yield started


@pytest.fixture
def gateway(replicas: EmulatedReplicas) -> Iterator[GatewayProcess]:
    with GatewayProcess(
        replicas.urls[:2], "--admin-token", TOKEN, "--drain-timeout", "60"
    ) as started:
        yield started


def listing(gateway: GatewayProcess) -> dict[str, dict[str, object]]:
    response = httpx.get(gateway.url + "/admin/backends", headers=AUTH, timeout=PATIENCE_SECONDS)
    assert response.status_code == 200
    return {item["name"]: item for item in response.json()["data"]}


def name_of(url: str) -> str:
    return url.removeprefix("http://")


def chat(gateway: GatewayProcess, session: str, max_tokens: int = 1) -> httpx.Response:
    return httpx.post(
        gateway.url + "/v1/chat/completions",
        headers={"x-session-id": session},
        json={
            "model": MODEL,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": f"hello from {session}"}],
        },
        timeout=10,
    )


def test_the_fleet_api_needs_the_admin_token(
    gateway: GatewayProcess, replicas: EmulatedReplicas
) -> None:
    first = name_of(replicas.urls[0])
    wait_until(lambda: all(item["healthy"] for item in listing(gateway).values()), "healthy")

    def membership() -> dict[str, tuple[object, ...]]:
        fields = ("url", "models", "healthy", "draining", "source")
        return {name: tuple(item[key] for key in fields) for name, item in listing(gateway).items()}

    pool = membership()
    assert httpx.get(gateway.url + "/admin/backends", timeout=PATIENCE_SECONDS).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert (
        httpx.get(
            gateway.url + "/admin/backends", headers=wrong, timeout=PATIENCE_SECONDS
        ).status_code
        == 403
    )
    refusals: tuple[tuple[dict[str, str], int, str], ...] = (
        ({}, 401, "authentication_error"),
        (wrong, 403, "permission_error"),
    )
    for headers, status, error_type in refusals:
        calls = [
            httpx.post(
                gateway.url + "/admin/backends",
                headers=headers,
                json={"url": "http://x:1"},
                timeout=PATIENCE_SECONDS,
            ),
            httpx.post(
                gateway.url + f"/admin/backends/{first}/drain",
                headers=headers,
                timeout=PATIENCE_SECONDS,
            ),
            httpx.post(
                gateway.url + f"/admin/backends/{first}/drain?wait=true",
                headers=headers,
                timeout=PATIENCE_SECONDS,
            ),
            httpx.delete(
                gateway.url + f"/admin/backends/{first}", headers=headers, timeout=PATIENCE_SECONDS
            ),
        ]
        for response in calls:
            assert response.status_code == status, response.request.url
            assert response.json()["error"]["type"] == error_type
    # Refused calls changed nothing: the same backends, none draining, all still routed to.
    assert membership() == pool
    served = {chat(gateway, f"after-refusals-{n}").headers["x-gateway-backend"] for n in range(30)}
    assert served == set(pool)


def test_lists_adds_and_removes_backends(
    gateway: GatewayProcess, replicas: EmulatedReplicas
) -> None:
    first, second, third = (name_of(url) for url in replicas.urls)
    wait_until(lambda: all(item["healthy"] for item in listing(gateway).values()), "healthy")
    backends = listing(gateway)
    assert set(backends) == {first, second}
    assert backends[first]["models"] == [MODEL]
    assert backends[first]["source"] == "static"
    assert backends[first]["draining"] is False

    added = httpx.post(
        gateway.url + "/admin/backends",
        headers=AUTH,
        json={"url": replicas.urls[2]},
        timeout=PATIENCE_SECONDS,
    )
    assert added.status_code == 201, added.text
    assert added.json()["healthy"] is True, "probed before the answer"
    assert added.json()["models"] == [MODEL]
    assert listing(gateway)[third]["source"] == "admin"
    served = {chat(gateway, f"session-{n}").headers["x-gateway-backend"] for n in range(30)}
    assert third in served, "the added replica takes its share of new sessions"

    again = httpx.post(
        gateway.url + "/admin/backends",
        headers=AUTH,
        json={"url": replicas.urls[2]},
        timeout=PATIENCE_SECONDS,
    )
    assert again.status_code == 409
    bad = httpx.post(
        gateway.url + "/admin/backends",
        headers=AUTH,
        json={"url": "ftp://x"},
        timeout=PATIENCE_SECONDS,
    )
    assert bad.status_code == 400
    assert bad.json()["error"]["code"] == "invalid_backend"
    pinned = httpx.post(
        gateway.url + "/admin/backends",
        headers=AUTH,
        json={"url": "http://127.0.0.1:9", "model": "other-model"},
        timeout=PATIENCE_SECONDS,
    )
    assert pinned.status_code == 201
    assert pinned.json()["models"] == ["other-model"]
    assert pinned.json()["healthy"] is False, "nothing listens there"

    removed = httpx.delete(
        gateway.url + f"/admin/backends/{third}", headers=AUTH, timeout=PATIENCE_SECONDS
    )
    assert removed.status_code == 200
    assert removed.json()["removed"] is True
    assert httpx.delete(
        gateway.url + "/admin/backends/127.0.0.1:9", headers=AUTH, timeout=PATIENCE_SECONDS
    ).is_success
    assert set(listing(gateway)) == {first, second}
    served = {chat(gateway, f"later-{n}").headers["x-gateway-backend"] for n in range(20)}
    assert served <= {first, second}
    missing = httpx.delete(
        gateway.url + f"/admin/backends/{third}", headers=AUTH, timeout=PATIENCE_SECONDS
    )
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "backend_not_found"


def test_drain_lets_the_stream_in_flight_finish(gateway: GatewayProcess) -> None:
    wait_until(lambda: all(item["healthy"] for item in listing(gateway).values()), "healthy")
    chunks: list[bytes] = []
    started = threading.Event()
    backend_holder: list[str] = []

    def stream() -> None:
        with httpx.stream(
            "POST",
            gateway.url + "/v1/chat/completions",
            json={
                "model": MODEL,
                "max_tokens": 200,  # five seconds: still running while its replica drains
                "stream": True,
                "messages": [{"role": "user", "content": "a long answer, please"}],
            },
            timeout=60,
        ) as response:
            backend_holder.append(response.headers["x-gateway-backend"])
            started.set()
            for chunk in response.iter_bytes():
                chunks.append(chunk)

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(10)
    draining = backend_holder[0]
    answer = httpx.post(gateway.url + f"/admin/backends/{draining}/drain", headers=AUTH, timeout=10)
    assert answer.status_code == 202
    assert answer.json()["draining"] is True
    assert answer.json()["in_flight"] == 1
    assert listing(gateway)[draining]["draining"] is True
    # New work goes elsewhere while the old stream runs on.
    for n in range(10):
        assert chat(gateway, f"during-drain-{n}").headers["x-gateway-backend"] != draining
    reader.join(60)
    body = b"".join(chunks)
    assert body.rstrip().endswith(b"data: [DONE]"), "the stream was cut off"
    assert body.count(b"data: ") >= 200
    wait_until(lambda: draining not in listing(gateway), "the drained backend removed")


def test_drain_and_wait_answers_once_the_backend_is_gone(
    gateway: GatewayProcess, replicas: EmulatedReplicas
) -> None:
    first = name_of(replicas.urls[0])
    wait_until(lambda: all(item["healthy"] for item in listing(gateway).values()), "healthy")
    answer = httpx.post(
        gateway.url + f"/admin/backends/{first}/drain?wait=true", headers=AUTH, timeout=15
    )
    assert answer.status_code == 200
    assert answer.json()["removed"] is True
    assert first not in listing(gateway)
    unknown = httpx.post(
        gateway.url + "/admin/backends/nowhere:1/drain", headers=AUTH, timeout=PATIENCE_SECONDS
    )
    assert unknown.status_code == 404
