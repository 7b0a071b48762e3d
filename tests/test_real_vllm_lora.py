"""LoRA adapters through the gateway in front of one real vLLM replica (CPU build, the tiny
model, `--enable-lora`, runtime LoRA updating): two random-weight adapters made in the test,
one served from the start and one declared in `lora_adapters` for the gateway to load.

One engine start for the module (the emulated replicas of tests/test_lora_adapters.py cover
the fleets of several replicas). `pytest --skip-real-vllm` (or SKIP_REAL_VLLM=1) skips it.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest

from engines.fleet import model_folder
from engines.lora_adapter import RANK, make_adapter
from engines.replica import VLLMReplica
from engines.tiny_model import ensure_model
from engines.venv import VLLMVenv
from tests.support import GatewayProcess, metric_value, wait_until

pytestmark = pytest.mark.real_vllm

MODEL = "tiny-llama"
PROMPT = "the hammer and the drill are kept on the shelf by the timber and the paint " * 8


@dataclass
class Served:
    replica: VLLMReplica
    gateway: GatewayProcess


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    venv = VLLMVenv().ensure()
    model = ensure_model(venv.python, model_folder())
    folder = tmp_path_factory.mktemp("adapters")
    static = make_adapter(folder / "static", seed=1)
    lazy = make_adapter(folder / "lazy", seed=2)
    replica = VLLMReplica(
        model,
        venv=venv,
        served_model_names=(MODEL,),
        extra_args=(
            "--enable-lora",
            "--max-lora-rank",
            str(RANK),
            "--max-loras",
            "2",
            "--lora-modules",
            f"static={static}",
        ),
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
    )
    config = folder / "gateway.yaml"
    config.write_text(f"lora_idle_unload: 4\nlora_adapters:\n  - {{name: lazy, path: {lazy}}}\n")
    with replica, GatewayProcess([replica.url], "--config", str(config)) as gateway:
        wait_until(lambda: "static" in replica_adapters(gateway), "the gateway lists `static`")
        yield Served(replica, gateway)


def replica_adapters(gateway: GatewayProcess) -> dict[str, str]:
    (view,) = httpx.get(gateway.url + "/admin/backends", timeout=10).json()["data"]
    adapters: dict[str, str] = view["adapters"]
    return adapters


def complete(gateway: GatewayProcess, model: str) -> int:
    """One completion of PROMPT under `model`; the cached tokens vLLM reported."""
    response = httpx.post(
        gateway.url + "/v1/completions",
        json={"model": model, "prompt": PROMPT, "max_tokens": 2},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    assert response.json()["model"] == model
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] or 0)


def predicted(gateway: GatewayProcess, model: str) -> float:
    text = gateway.metrics()
    return metric_value(text, "gateway_matched_tokens_predicted_total", model=model)


def test_the_adapters_are_listed_with_their_base_model(served: Served) -> None:
    cards = httpx.get(served.gateway.url + "/v1/models", timeout=10).json()["data"]
    assert {card["id"]: card["parent"] for card in cards} == {
        MODEL: None,
        "static": MODEL,
        "lazy": MODEL,
    }
    assert replica_adapters(served.gateway) == {"static": MODEL}


def test_an_adapter_repeat_hits_the_cache_and_the_base_model_shares_nothing(
    served: Served,
) -> None:
    gateway = served.gateway
    complete(gateway, "static")
    assert complete(gateway, "static") > 0
    assert predicted(gateway, "static") > 0
    before = predicted(gateway, MODEL)
    assert complete(gateway, MODEL) == 0
    assert predicted(gateway, MODEL) == before


def test_six_first_requests_load_a_declared_adapter_once(served: Served) -> None:
    gateway, replica = served.gateway, served.replica
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda _: complete(gateway, "lazy"), range(6)))
    text = gateway.metrics()
    assert metric_value(text, "gateway_lora_adapter_loads_total", adapter="lazy") == 1
    assert replica.log().count("Loaded new LoRA adapter: name 'lazy'") == 1
    assert complete(gateway, "lazy") > 0  # reused: its prompt is cached under it
    listed = httpx.get(replica.url + "/v1/models", timeout=10).json()["data"]
    assert {card["id"]: card["parent"] for card in listed}["lazy"] == MODEL
    # Idle for lora_idle_unload seconds: unloaded from the replica.
    wait_until(lambda: "lazy" not in replica_adapters(gateway), "`lazy` unloaded")
    listed = httpx.get(replica.url + "/v1/models", timeout=10).json()["data"]
    assert "lazy" not in {card["id"] for card in listed}
