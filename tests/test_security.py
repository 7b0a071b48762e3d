"""Secure by default: the admin API, what replicas are sent, loops, keys and tenants.

Each test runs the attack against a real gateway process and checks that normal requests keep
succeeding beside it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from gateway.auth import AdminAccess, is_loopback
from gateway.emulator.replicas import EmulatedReplicas
from gateway.processes import free_port
from tests.fault_servers import FaultServer
from tests.support import GatewayProcess, metric_value

MODEL = "emulated-model"
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


def wait_until(condition: Callable[[], bool], seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def chat(url: str, content: str = "hello", **headers: str) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=20)


@pytest.fixture(scope="module")
def replicas() -> Iterator[EmulatedReplicas]:
    with EmulatedReplicas(2, MODEL) as started:
        yield started


def test_who_may_use_the_admin_api() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    assert AdminAccess("", "127.0.0.1").open
    assert AdminAccess("", "0.0.0.0").disabled
    guarded = AdminAccess(TOKEN, "0.0.0.0")
    assert not guarded.open and not guarded.disabled
    guarded.check(f"Bearer {TOKEN}".encode())


def test_beyond_loopback_the_admin_api_is_off_without_a_token(replicas: EmulatedReplicas) -> None:
    with WideGateway(replicas.urls) as gateway:
        for method, path in (
            ("GET", "/admin/backends"),
            ("POST", "/admin/backends"),
            ("POST", "/admin/explain"),
            ("DELETE", f"/admin/backends/{replicas.urls[0].removeprefix('http://')}"),
        ):
            refused = httpx.request(method, gateway.url + path, json={"url": "http://x:1"})
            assert refused.status_code == 403, (method, path)
            assert refused.json()["error"]["code"] == "admin_disabled"
        assert chat(gateway.url).status_code == 200
        listed = httpx.get(gateway.url + "/v1/models").json()["data"]
        assert [model["id"] for model in listed] == [MODEL]


def test_beyond_loopback_the_token_opens_it(replicas: EmulatedReplicas) -> None:
    with WideGateway(replicas.urls, "--admin-token", TOKEN) as gateway:
        assert httpx.get(gateway.url + "/admin/backends").status_code == 401
        wrong = httpx.get(gateway.url + "/admin/backends", headers={"authorization": "Bearer no"})
        assert wrong.status_code == 403 and wrong.json()["error"]["code"] == "invalid_token"
        assert httpx.get(gateway.url + "/admin/backends", headers=BEARER).status_code == 200


def test_an_added_backend_url_is_checked(replicas: EmulatedReplicas) -> None:
    refused = [
        "http://user:password@10.0.0.1:8000",
        "http://10.0.0.1:8000 ",
        "http://10.0.0.1:8000\r\nx-injected: 1",
        "http://10.0.0.1:8000/v1?redirect=x",
        "file:///etc/passwd",
        "http://10.0.0.1:99999",
    ]
    with GatewayProcess(replicas.urls, "--admin-token", TOKEN) as gateway:
        for url in refused:
            added = httpx.post(gateway.url + "/admin/backends", json={"url": url}, headers=BEARER)
            assert added.status_code == 400, url
            assert added.json()["error"]["code"] == "invalid_backend"
        listing = httpx.get(gateway.url + "/admin/backends", headers=BEARER).json()["data"]
        assert len(listing) == 2
        assert chat(gateway.url).status_code == 200


def test_the_gateway_cannot_be_added_to_itself(replicas: EmulatedReplicas) -> None:
    with GatewayProcess(replicas.urls, "--admin-token", TOKEN) as gateway:
        for url in (
            gateway.url,
            f"http://localhost:{gateway.port}",
            f"http://127.0.0.9:{gateway.port}",
        ):
            added = httpx.post(gateway.url + "/admin/backends", json={"url": url}, headers=BEARER)
            assert added.status_code == 400, url
        assert chat(gateway.url).status_code == 200


def test_a_request_that_comes_back_stops_after_one_hop(replicas: EmulatedReplicas) -> None:
    # A backend that is the gateway itself, under a name validation cannot see through.
    port = free_port()
    own = f"{MODEL}-loop=http://127.0.0.1:{port}"
    gateway = GatewayProcess([*replicas.urls, own], "--max-attempts", "1")
    gateway.port = port
    with gateway:
        # Its probe of itself passes once it listens.
        wait_until(
            lambda: all(
                item["healthy"]
                for item in httpx.get(gateway.url + "/admin/backends").json()["data"]
            )
        )
        body = {"model": f"{MODEL}-loop", "messages": [{"role": "user", "content": "x"}]}
        looped = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=20)
        assert looped.status_code == 508
        assert looped.json()["error"]["code"] == "loop_detected"
        text = gateway.metrics()
        # The client's request and the one that came back: one extra hop, no more.
        assert metric_value(text, "gateway_rejected_requests_total", status="508") == 1
        assert chat(gateway.url).status_code == 200


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
        )
        assert response.status_code == 201
        for turn in range(8):
            assert (
                chat(gateway.url, f"turn {turn}", authorization="Bearer client").status_code == 200
            )
        assert configured.seen and added.seen
        assert {r.headers.get("authorization") for r in configured.seen} == {"Bearer replica-key"}
        assert {r.headers.get("authorization") for r in added.seen} == {None}


def test_hop_by_hop_headers_stop_and_forwarding_headers_are_added() -> None:
    with FaultServer() as replica, GatewayProcess([f"{MODEL}={replica.url}"]) as gateway:
        response = chat(
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


def test_session_keys_are_bounded_and_kept_only_as_hashes(replicas: EmulatedReplicas) -> None:
    with GatewayProcess(replicas.urls) as gateway:
        long = chat(gateway.url, **{"x-session-id": "k" * 513})
        assert long.status_code == 400
        assert long.json()["error"]["code"] == "session_key_too_long"
        explained = httpx.post(
            gateway.url + "/admin/explain",
            json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
            headers={"x-session-id": "secret-session"},
        ).json()
        assert explained["session_key"] != "secret-session" and len(explained["session_key"]) == 16
        assert chat(gateway.url, **{"x-session-id": "k" * 512}).status_code == 200


def test_a_body_of_nested_arrays_is_refused_before_it_is_parsed(
    replicas: EmulatedReplicas,
) -> None:
    with GatewayProcess(replicas.urls) as gateway:
        nested = (
            b'{"model":"m","messages":[{"role":"user","content":"x"}],"tools":'
            + (b"[" * 300 + b"]" * 300)
            + b"}"
        )
        deep = httpx.post(gateway.url + "/v1/chat/completions", content=nested)
        assert deep.status_code == 400 and deep.json()["error"]["code"] == "too_deep"
        many = b'{"model":"m","prompt":[' + b",".join([b"[1]"] * 300_000) + b"]}"
        wide = httpx.post(gateway.url + "/v1/completions", content=many)
        assert wide.status_code == 400 and wide.json()["error"]["code"] == "too_many_values"
        assert chat(gateway.url).status_code == 200


def test_the_last_replica_refusing_connections_is_an_openai_503() -> None:
    with EmulatedReplicas(1, MODEL) as replica, GatewayProcess(replica.urls) as gateway:
        assert chat(gateway.url).status_code == 200
        replica.replicas[0].kill()
        answers = [chat(gateway.url) for _ in range(3)]
        for answer in answers:
            assert answer.status_code in (502, 503)
            error = answer.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert "127.0.0.1" not in answer.text
        assert answers[-1].status_code == 503


def test_removed_backends_leave_the_metrics(replicas: EmulatedReplicas) -> None:
    with GatewayProcess(replicas.urls) as gateway:
        for turn in range(6):
            assert chat(gateway.url, f"warm {turn}").status_code == 200
        gone = replicas.urls[0].removeprefix("http://")
        assert f'backend="{gone}"' in gateway.metrics()
        assert httpx.delete(gateway.url + f"/admin/backends/{gone}").status_code == 200
        assert f'backend="{gone}"' not in gateway.metrics()
        assert chat(gateway.url).status_code == 200


def test_tenants_neither_hit_nor_probe_each_others_prefixes(replicas: EmulatedReplicas) -> None:
    with GatewayProcess(
        replicas.urls, "--api-key", "tenant-a", "--api-key", "tenant-b", "--isolate-tenants"
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


def test_tenant_isolation_needs_client_keys() -> None:
    from gateway.config import ConfigError, Settings

    with pytest.raises(ConfigError):
        Settings(backend=("x",), isolate_tenants=True).validate()
    dataclasses.replace(Settings(backend=("x",)), isolate_tenants=True, api_key=("k",)).validate()
