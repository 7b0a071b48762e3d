"""What a tenant's client is told of the fleet, and what the operator is told of the tenant:
`x-gateway-backend` names the replica by an opaque name unless the operator asks for its
address (`--backend-header address`) or for nothing (`off`); the access log names each
request's tenant. A real gateway (with its access log) in front of two recording replicas.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml

from tests.fault_servers import FaultServer
from tests.support import GatewayProcess

MODEL = "visible-model"
TENANTS = [{"name": "search", "api_key": "search-key"}]
ANONYMOUS_KEY = "anonymous-key"


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[FaultServer]]:
    with FaultServer() as first, FaultServer() as second:
        yield [first, second]


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("visibility") / "gateway.yaml"
    path.write_text(yaml.safe_dump({"tenants": TENANTS}))
    return path


def gateway_with(replicas: list[FaultServer], config: Path, header: str | None) -> GatewayProcess:
    # GatewayProcess asks for addresses (tests read them); None: the gateway's default.
    env = {"GATEWAY_BACKEND_HEADER": header} if header else {"GATEWAY_BACKEND_HEADER": "name"}
    args = ("--config", str(config), "--api-key", ANONYMOUS_KEY, "--access-log")
    return GatewayProcess([f"{MODEL}={r.url}" for r in replicas], *args, env=env)


def ask(
    gateway: GatewayProcess, key: str | None, prompt: str, model: str = MODEL
) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(
        gateway.url + "/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": prompt}]},
        headers=headers,
        timeout=30,
    )


def access_line(gateway: GatewayProcess, request_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for line in gateway.log().splitlines():
            if line.startswith("{") and f'"request_id":"{request_id}"' in line:
                parsed: dict[str, Any] = orjson.loads(line)
                return parsed
        time.sleep(0.05)
    raise AssertionError(f"no access-log line for {request_id}")


def test_by_default_a_client_is_told_an_opaque_name_not_an_address(
    replicas: list[FaultServer], config: Path
) -> None:
    with gateway_with(replicas, config, None) as gateway:
        names: dict[str, str] = {}
        for turn in range(40):
            answer = ask(gateway, "search-key", f"question {turn} " * 20)
            assert answer.status_code == 200
            public = answer.headers["x-gateway-backend"]
            assert re.fullmatch(r"replica-[0-9a-f]{12}", public), public
            line = access_line(gateway, answer.headers["x-request-id"])
            # The operator's side: the access line names the replica by its address.
            assert names.setdefault(line["backend"], public) == public
        addresses = {r.url.removeprefix("http://") for r in replicas}
        assert set(names) == addresses  # each replica its own name, the same every time
        assert len(set(names.values())) == 2
        listing = httpx.get(gateway.url + "/admin/backends", timeout=10).json()["data"]
        assert {item["name"]: item["public_name"] for item in listing} == names


@pytest.mark.parametrize(("header", "shown"), [("address", True), ("off", False)])
def test_the_operator_may_show_the_address_or_nothing(
    replicas: list[FaultServer], config: Path, header: str, shown: bool
) -> None:
    with gateway_with(replicas, config, header) as gateway:
        answer = ask(gateway, "search-key", "where did this go?")
        assert answer.status_code == 200
        line = access_line(gateway, answer.headers["x-request-id"])
        if shown:
            assert answer.headers["x-gateway-backend"] == line["backend"]
        else:
            assert "x-gateway-backend" not in answer.headers
            assert answer.headers["x-gateway-route"]


def test_the_access_log_names_each_requests_tenant(
    replicas: list[FaultServer], config: Path
) -> None:
    with gateway_with(replicas, config, "address") as gateway:
        served = ask(gateway, "search-key", "mine")
        anonymous = ask(gateway, ANONYMOUS_KEY, "ours")
        refused = ask(gateway, "search-key", "nowhere", model="no-such-model")
        assert (served.status_code, anonymous.status_code, refused.status_code) == (200, 200, 404)
        assert access_line(gateway, served.headers["x-request-id"])["tenant"] == "search"
        assert access_line(gateway, anonymous.headers["x-request-id"])["tenant"] == "anonymous"
        line = access_line(gateway, refused.headers["x-request-id"])
        assert (line["tenant"], line["status"], line["error"]) == ("search", 404, "model_not_found")
