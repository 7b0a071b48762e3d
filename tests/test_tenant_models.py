"""A tenant's `models:` list: the models and adapters it may use. `/v1/models` shows it those
alone, and a request for any other model gets the 404 a model that does not exist gets; a
tenant without a list, and a client of an `--api-key` key, see and use every model. Real
gateway, two recording replicas of two base models, a declared LoRA adapter, the official
client.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
import yaml

from tests.fault_servers import FaultServer
from tests.support import GatewayProcess, wait_until

BASE_A, BASE_B, ADAPTER = "base-a", "base-b", "sql-lora"
EVERY = sorted([ADAPTER, BASE_A, BASE_B])
TENANTS = [
    {"name": "search", "api_key": "search-key", "models": [BASE_A, ADAPTER]},
    {"name": "batch", "api_key": "batch-key"},
]
ANONYMOUS_KEY = "anonymous-key"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    config = tmp_path_factory.mktemp("tenant-models") / "gateway.yaml"
    adapters = [{"name": ADAPTER, "path": "/adapters/sql", "base_model": BASE_A}]
    config.write_text(yaml.safe_dump({"tenants": TENANTS, "lora_adapters": adapters}))
    with (
        FaultServer(models=[BASE_A]) as first,
        FaultServer(models=[BASE_B]) as second,
        GatewayProcess(
            [first.url, second.url], "--config", str(config), "--api-key", ANONYMOUS_KEY
        ) as started,
    ):
        wait_until(lambda: listed(started, ANONYMOUS_KEY) == EVERY, "both replicas' models")
        yield started


def listed(gateway: GatewayProcess, key: str) -> list[str]:
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0) as client:
        return sorted(model.id for model in client.models.list())


def chat(gateway: GatewayProcess, key: str, model: str) -> httpx.Response:
    return httpx.post(
        gateway.url + "/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"authorization": f"Bearer {key}"},
        timeout=30,
    )


def test_a_tenant_sees_only_its_models(gateway: GatewayProcess) -> None:
    assert listed(gateway, "search-key") == sorted([BASE_A, ADAPTER])
    assert listed(gateway, "batch-key") == EVERY
    assert listed(gateway, ANONYMOUS_KEY) == EVERY


def test_another_model_is_one_that_does_not_exist_for_it(gateway: GatewayProcess) -> None:
    refused = chat(gateway, "search-key", BASE_B)
    missing = chat(gateway, "search-key", "no-such-model")
    assert refused.status_code == missing.status_code == 404
    error, unknown = refused.json()["error"], missing.json()["error"]
    assert error["code"] == unknown["code"] == "model_not_found"
    assert error["message"].replace(BASE_B, "M") == unknown["message"].replace("no-such-model", "M")
    with (
        openai.OpenAI(base_url=gateway.url + "/v1", api_key="search-key", max_retries=0) as client,
        pytest.raises(openai.NotFoundError),
    ):
        client.completions.create(model=BASE_B, prompt="hi", max_tokens=2)


def test_its_own_models_and_everyone_elses_are_served(gateway: GatewayProcess) -> None:
    assert chat(gateway, "search-key", BASE_A).status_code == 200
    for key in ("batch-key", ANONYMOUS_KEY):
        assert chat(gateway, key, BASE_B).status_code == 200
