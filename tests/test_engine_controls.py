"""What steers the engine's internals is the gateway's to set: a client's `priority` (body or
`X-Vllm-Priority`), `request_id`, `kv_transfer_params` and `X-Data-Parallel-Rank` reach the
replica dropped or made its tenant's own, unless the operator allows them (`--engine-control`)
or gives the tenant a range of priorities of its own (`priority_range`). A recording replica
shows what the engine was sent; a body with none of them goes byte for byte.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from prefix_gateway.config import ConfigError, load_settings
from tests.fault_servers import FaultServer, Request
from tests.support import GatewayProcess

MODEL = "controlled-model"
TENANTS: list[dict[str, Any]] = [
    {"name": "search", "api_key": "search-key", "priority": 1, "priority_range": [0, 10]},
    {"name": "batch", "api_key": "batch-key", "priority": -1},
]
ANONYMOUS_KEY = "anonymous-key"
CHAT: dict[str, Any] = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "who steers the engine?"}],
    "max_tokens": 4,
}
CONTROLS: dict[str, Any] = {
    "priority": -1000,
    "request_id": "resp_mine",
    "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "elsewhere"},
}
HEADERS = {"x-vllm-priority": "-1000", "x-data-parallel-rank": "3"}


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("engine-controls") / "gateway.yaml"
    path.write_text(yaml.safe_dump({"tenants": TENANTS}))
    return path


@pytest.fixture(scope="module")
def replica() -> Iterator[FaultServer]:
    with FaultServer() as started:
        yield started


def started(replica: FaultServer, *args: str) -> GatewayProcess:
    return GatewayProcess([f"{MODEL}={replica.url}"], *args)


@pytest.fixture(scope="module")
def gateway(replica: FaultServer, config: Path) -> Iterator[GatewayProcess]:
    with started(replica, "--config", str(config), "--api-key", ANONYMOUS_KEY) as running:
        yield running


def send(
    gateway: GatewayProcess,
    key: str | None,
    body: bytes,
    headers: dict[str, str] | None = None,
    path: str = "/v1/chat/completions",
) -> httpx.Response:
    sent = {"content-type": "application/json", **(headers or {})}
    if key is not None:
        sent["authorization"] = f"Bearer {key}"
    return httpx.post(gateway.url + path, content=body, headers=sent, timeout=30)


def reached(
    gateway: GatewayProcess,
    replica: FaultServer,
    key: str | None,
    fields: dict[str, Any],
    headers: dict[str, str] | None = None,
    path: str = "/v1/chat/completions",
) -> Request:
    """What the replica got of a chat sending `fields` besides CHAT's."""
    body = json.dumps({**CHAT, **fields}).encode()
    answer = send(gateway, key, body, headers, path)
    assert answer.status_code == 200, answer.text
    request_id = answer.headers["x-request-id"]
    (got,) = [r for r in replica.seen if r.headers.get("x-request-id") == request_id]
    return got


def test_a_body_without_engine_controls_goes_byte_for_byte(
    gateway: GatewayProcess, replica: FaultServer
) -> None:
    body = b'{ "model" : "controlled-model", "messages":[{"role":"user","content":"as is"}] }'
    answer = send(gateway, "batch-key", body)
    assert answer.status_code == 200
    (got,) = [
        r for r in replica.seen if r.headers["x-request-id"] == answer.headers["x-request-id"]
    ]
    assert got.body == body


@pytest.mark.parametrize(("key", "owner"), [("batch-key", "batch"), (ANONYMOUS_KEY, "anonymous")])
def test_a_clients_engine_controls_are_dropped_or_made_its_own(
    gateway: GatewayProcess, replica: FaultServer, key: str, owner: str
) -> None:
    got = reached(gateway, replica, key, CONTROLS, HEADERS)
    sent = json.loads(got.body)
    assert "priority" not in sent and "kv_transfer_params" not in sent
    assert sent["request_id"] == f"{owner}:resp_mine"
    assert "x-vllm-priority" not in got.headers and "x-data-parallel-rank" not in got.headers
    assert {name: sent[name] for name in CHAT} == CHAT


def test_another_tenants_request_id_cannot_be_taken(
    gateway: GatewayProcess, replica: FaultServer
) -> None:
    """Naming the id another tenant's request was given makes another one still."""
    taken = reached(gateway, replica, "search-key", {"request_id": "resp_1"})
    assert json.loads(taken.body)["request_id"] == "search:resp_1"
    forged = reached(gateway, replica, "batch-key", {"request_id": "search:resp_1"})
    assert json.loads(forged.body)["request_id"] == "batch:search:resp_1"


@pytest.mark.parametrize("asked", [0, 7, 10])
def test_a_tenant_with_a_range_sets_its_own_priority_within_it(
    gateway: GatewayProcess, replica: FaultServer, asked: int
) -> None:
    body = json.dumps({**CHAT, "priority": asked}).encode()
    answer = send(gateway, "search-key", body, {"x-vllm-priority": "-1000"})
    assert answer.status_code == 200, answer.text
    (got,) = [
        r for r in replica.seen if r.headers["x-request-id"] == answer.headers["x-request-id"]
    ]
    assert got.body == body  # what it asked is what is sent: nothing to rewrite
    assert "x-vllm-priority" not in got.headers


@pytest.mark.parametrize("asked", [-1, 11, -1000, "high", 2.5, True])
def test_a_priority_outside_the_tenants_range_is_refused(
    gateway: GatewayProcess, replica: FaultServer, asked: object
) -> None:
    before = len(replica.seen)
    answer = send(gateway, "search-key", json.dumps({**CHAT, "priority": asked}).encode())
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["code"] == "priority_out_of_range" and error["param"] == "priority"
    assert "0 to 10" in error["message"]
    assert len(replica.seen) == before


def test_with_forward_priority_the_range_still_lets_a_tenant_choose(
    replica: FaultServer, config: Path
) -> None:
    args = ("--config", str(config), "--api-key", ANONYMOUS_KEY, "--forward-priority")
    with started(replica, *args) as gateway:
        chosen = reached(gateway, replica, "search-key", {"priority": 4}, HEADERS)
        assert json.loads(chosen.body)["priority"] == 4
        unset = reached(gateway, replica, "search-key", {})
        assert json.loads(unset.body)["priority"] == -1  # its tenant's, negated
        batch = reached(gateway, replica, "batch-key", {"priority": -1000}, HEADERS)
        assert json.loads(batch.body)["priority"] == 1
        assert "x-vllm-priority" not in batch.headers
        messages = {
            "model": MODEL,
            "max_tokens": 4,
            "priority": 3,
            "messages": [{"role": "user", "content": "hi"}],
        }
        answer = send(gateway, "search-key", json.dumps(messages).encode(), path="/v1/messages")
        assert answer.status_code == 200, answer.text
        (got,) = [
            r for r in replica.seen if r.headers["x-request-id"] == answer.headers["x-request-id"]
        ]
        assert got.headers["x-vllm-priority"] == "3"


def test_the_operator_may_let_clients_set_them(replica: FaultServer, config: Path) -> None:
    allowed = ("priority", "request_id", "kv_transfer_params", "data_parallel_rank")
    args = ["--config", str(config)]
    for name in allowed:
        args += ["--engine-control", name]
    with started(replica, *args) as gateway:
        body = json.dumps({**CHAT, **CONTROLS}).encode()
        answer = send(gateway, "batch-key", body, HEADERS)
        assert answer.status_code == 200, answer.text
        (got,) = [
            r for r in replica.seen if r.headers["x-request-id"] == answer.headers["x-request-id"]
        ]
        assert got.body == body
        assert got.headers["x-vllm-priority"] == "-1000"
        assert got.headers["x-data-parallel-rank"] == "3"


def test_without_tenants_request_id_goes_as_sent_and_the_rest_is_dropped(
    replica: FaultServer,
) -> None:
    with started(replica) as gateway:
        got = reached(gateway, replica, None, CONTROLS, HEADERS)
        sent = json.loads(got.body)
        assert sent["request_id"] == "resp_mine"  # one tenant: nobody else's ids to take
        assert "priority" not in sent and "kv_transfer_params" not in sent
        assert "x-vllm-priority" not in got.headers and "x-data-parallel-rank" not in got.headers


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        ({"priority_range": [5, 1]}, "priority_range must be"),
        ({"priority_range": [0]}, "priority_range must be"),
        ({"priority_range": [0, "9"]}, "priority_range must be"),
        ({"priority_range": [0, 2**63]}, "priority_range must be"),
        ({"models": []}, "models must be"),
        ({"models": "m"}, "models must be"),
    ],
)
def test_a_bad_entry_is_a_start_up_error(tmp_path: Path, entry: dict[str, Any], why: str) -> None:
    config = tmp_path / "gateway.yaml"
    tenant = {"name": "t", "api_key": "k", **entry}
    config.write_text(yaml.safe_dump({"backend": ["http://a:1"], "tenants": [tenant]}))
    with pytest.raises(ConfigError, match=rf"tenants\[0\] \(t\): {why}"):
        load_settings(environ={"GATEWAY_CONFIG": str(config)})


def test_an_unknown_engine_control_is_a_start_up_error() -> None:
    with pytest.raises(ConfigError, match="engine_control: unknown"):
        load_settings(
            environ={"GATEWAY_BACKENDS": "http://a:1", "GATEWAY_ENGINE_CONTROL": "everything"}
        )
