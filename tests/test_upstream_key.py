"""`--upstream-api-key` goes only to the replicas the operator configured with it: those given
on the command line (or found by discovery), and one added through the admin API only when its
entry asks (`"upstream_key": true`). Three recording replicas, one of each, see every kind of
request the gateway makes of its own accord (health probes, model listings, `/metrics`
scrapes, the doctor's checks, on-demand adapter loads and idle unloads) besides the clients'
requests; each request either carries the key or does not, as its replica's entry says. (A
request the gateway gives up, its client gone, is aborted by closing its connection: no request
of its own is sent for that.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.fault_servers import FaultServer, Request
from tests.support import GatewayProcess, wait_until

MODEL = "keyed-model"
ADAPTER = "sql-lora"
IDLE_ADAPTER = "idle-lora"
KEY = "replica-key"
TOKEN = "admin-token"
ADMIN = {"authorization": f"Bearer {TOKEN}"}
# What the gateway sends a replica of its own accord, and the clients' requests.
KINDS = {
    ("GET", "/health"),  # health probes (and the doctor's)
    ("GET", "/v1/models"),  # model listings
    ("GET", "/metrics"),  # engine load scrapes
    ("POST", "/v1/chat/completions"),  # the doctor's cache check, and clients' requests
    ("POST", "/v1/load_lora_adapter"),  # adapters loaded on demand
}


def _kinds(replica: FaultServer) -> set[tuple[str, str]]:
    return {(request.method, request.path.partition("?")[0]) for request in replica.every}


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("upstream-key") / "gateway.yaml"
    adapters = [
        {"name": ADAPTER, "path": "/adapters/sql", "base_model": MODEL},
        {"name": IDLE_ADAPTER, "path": "/adapters/idle", "base_model": MODEL},
    ]
    path.write_text(yaml.safe_dump({"lora_adapters": adapters, "lora_idle_unload": 1}))
    return path


@pytest.fixture(scope="module")
def replicas() -> Iterator[tuple[FaultServer, FaultServer, FaultServer]]:
    with (
        FaultServer(models=[MODEL]) as configured,
        FaultServer(models=[MODEL]) as added,
        FaultServer(models=[MODEL]) as added_with_key,
    ):
        yield configured, added, added_with_key


def test_the_key_reaches_only_the_replicas_configured_with_it(
    replicas: tuple[FaultServer, FaultServer, FaultServer], config: Path
) -> None:
    configured, added, added_with_key = replicas
    args = (
        "--config",
        str(config),
        "--upstream-api-key",
        KEY,
        "--admin-token",
        TOKEN,
        "--scrape-interval",
        "0.2",
        "--models-interval",
        "0.5",
        "--max-attempts",
        "3",
    )
    env = {"GATEWAY_DOCTOR_INTERVAL": "0.5"}
    with GatewayProcess([configured.url], *args, env=env) as gateway:
        for replica, asks in ((added, False), (added_with_key, True)):
            answer = httpx.post(
                gateway.url + "/admin/backends",
                json={"url": replica.url, "upstream_key": asks},
                headers=ADMIN,
                timeout=30,
            )
            assert answer.status_code == 201, answer.text
            assert answer.json()["upstream_key"] is asks
        every = (configured, added, added_with_key)
        # Clients' requests, spread by their prompts until each replica has had some.
        turn = 0
        while not all(any("via" in r.headers for r in replica.seen) for replica in every):
            answer = httpx.post(
                gateway.url + "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": f"q{turn} " * 40}]},
                timeout=30,
            )
            assert answer.status_code == 200, answer.text
            turn += 1
            assert turn < 200, "the clients' requests never reached every replica"
        wait_until(
            lambda: all(
                KINDS - {("POST", "/v1/load_lora_adapter")} <= _kinds(r)
                and any("via" not in seen.headers for seen in r.seen)
                for r in every
            ),
            "probes, listings, scrapes and the doctor's checks at every replica",
        )
        # One loads the idle adapter, and unloads it once it has gone unused.
        loaded = httpx.post(
            gateway.url + "/v1/chat/completions",
            json={"model": IDLE_ADAPTER, "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        assert loaded.status_code == 200, loaded.text
        wait_until(
            lambda: any(("POST", "/v1/unload_lora_adapter") in _kinds(r) for r in every),
            "the idle adapter unloaded",
        )
        # Each replica refuses the load: it is tried on every one of them.
        for replica in every:
            replica.mode = "error"
        refused = httpx.post(
            gateway.url + "/v1/chat/completions",
            json={"model": ADAPTER, "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        assert refused.status_code == 503, refused.text
        for replica in every:
            replica.mode = "ok"
    for replica in every:
        assert _kinds(replica) >= KINDS, _kinds(replica)
        doctors = [
            r for r in replica.seen if r.path == "/v1/chat/completions" and "via" not in r.headers
        ]
        assert doctors, "the doctor's checks reached every replica"

    def keys(replica: FaultServer) -> set[str | None]:
        return {request.headers.get("authorization") for request in replica.every}

    assert keys(configured) == {f"Bearer {KEY}"}
    assert keys(added_with_key) == {f"Bearer {KEY}"}
    assert keys(added) == {None}
    leaked: list[Request] = [
        r for r in added.every if KEY in str(r.headers) or KEY.encode() in r.body
    ]
    assert leaked == []
