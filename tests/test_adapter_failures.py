"""A declared LoRA adapter whose load fails everywhere: a burst of a tenant's requests for it
makes one load call per replica, not one per request; every request is told `adapter
unavailable` with `Retry-After` and nothing of what the replicas said; and the tenant is
charged as a request the gateway refused is (nothing). Two recording replicas that refuse
every load, a tenant with budgets, the gateway as a real process.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import yaml

from prefix_gateway.backends.adapters import FIRST_BACKOFF
from tests.fault_servers import FaultServer
from tests.support import GatewayProcess, wait_until

MODEL = "base-model"
ADAPTER = "broken-lora"
KEY = "search-key"
TOKENS_PER_MINUTE = 100_000
BURST = 40
LOAD = ("POST", "/v1/load_lora_adapter")


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[FaultServer]]:
    # "error": every POST, a load included, gets a 500 saying "the replica failed".
    with FaultServer(models=[MODEL]) as first, FaultServer(models=[MODEL]) as second:
        yield [first, second]


@pytest.fixture(scope="module")
def gateway(
    replicas: list[FaultServer], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    config = tmp_path_factory.mktemp("adapter-failures") / "gateway.yaml"
    tenant = {
        "name": "search",
        "api_key": KEY,
        "tokens_per_minute": TOKENS_PER_MINUTE,
        "requests_per_minute": 10_000,
    }
    adapter = {"name": ADAPTER, "path": "/srv/secret/adapters/broken", "base_model": MODEL}
    config.write_text(yaml.safe_dump({"tenants": [tenant], "lora_adapters": [adapter]}))
    with GatewayProcess([r.url for r in replicas], "--config", str(config)) as started:
        wait_until(
            lambda: all(
                item["models"] == [MODEL]
                for item in httpx.get(started.url + "/admin/backends", timeout=10).json()["data"]
            ),
            "both replicas listed",
        )
        for replica in replicas:
            replica.mode = "error"
        yield started


def ask(gateway: GatewayProcess) -> httpx.Response:
    return httpx.post(
        gateway.url + "/v1/chat/completions",
        json={"model": ADAPTER, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
        headers={"authorization": f"Bearer {KEY}"},
        timeout=60,
    )


def loads(replicas: list[FaultServer]) -> list[int]:
    return [sum((r.method, r.path) == LOAD for r in replica.every) for replica in replicas]


def test_a_burst_makes_one_load_per_replica_and_is_told_adapter_unavailable(
    gateway: GatewayProcess, replicas: list[FaultServer]
) -> None:
    started = time.monotonic()
    with ThreadPoolExecutor(BURST) as pool:
        answers = list(pool.map(lambda _: ask(gateway), range(BURST)))
    answers += [ask(gateway) for _ in range(BURST)]
    # One load per replica, then none before its pause is over: on a machine slow enough for
    # the requests to outlast a pause, one more each time one ends.
    most = 1 + int((time.monotonic() - started) // FIRST_BACKOFF)
    assert all(1 <= made <= most for made in loads(replicas)), (loads(replicas), most)
    for answer in answers:
        assert answer.status_code == 503, answer.text
        error = answer.json()["error"]
        assert error["code"] == "adapter_unavailable"
        assert error["message"].startswith("adapter unavailable")
        assert "replica failed" not in answer.text and "/srv/secret" not in answer.text
        assert 1 <= int(answer.headers["retry-after"]) <= FIRST_BACKOFF * 2 ** (most - 1)
    # Charged as a refusal by the gateway is: nothing used, the reservations given back.
    (view,) = httpx.get(gateway.url + "/admin/tenants", timeout=10).json()["data"]
    assert view["requests"] == {"503": 2 * BURST}
    assert view["tokens"] == {"prompt": 0, "cached": 0, "completion": 0}
    assert view["reserved_tokens"] == 0 and view["in_flight"] == 0
    assert view["budgets"]["tokens"]["remaining"] == pytest.approx(TOKENS_PER_MINUTE, rel=0.01)
