"""LoRA adapters through the gateway in front of two real vLLM replicas (CPU build, the tiny
model, `--enable-lora`, runtime LoRA updating), with random-weight adapters made in the test:
`only-a` served by the first replica alone, `only-b` by the second alone, `both` by both, and
`lazy` declared in `lora_adapters` for the gateway to load where its policy picks.

The two engines start at once, pinned to different cores (engines.fleet.VLLMFleet), for the
module. `pytest --skip-real-vllm` (or SKIP_REAL_VLLM=1) skips it.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from engines.fleet import VLLMFleet, model_folder
from engines.lora_adapter import RANK, make_adapter
from engines.replica import VLLMReplica
from engines.tiny_model import ensure_model
from engines.venv import VLLMVenv
from tests.support import GatewayProcess, metric_value, wait_until

pytestmark = pytest.mark.real_vllm

MODEL = "tiny-llama"
PROMPT = "the hammer and the drill are kept on the shelf by the timber and the paint " * 8
# What each replica serves from its start, besides the base model.
STARTED_WITH = ({"only-a", "both"}, {"only-b", "both"})


@dataclass
class Served:
    replicas: list[VLLMReplica]
    gateway: GatewayProcess

    def name(self, index: int) -> str:
        """The replica's name in the gateway (`x-gateway-backend`, /admin/backends)."""
        replica = self.replicas[index]
        return f"{replica.host}:{replica.port}"

    def index(self, name: str) -> int:
        """The position of the replica the gateway calls `name`."""
        return [self.name(index) for index in range(len(self.replicas))].index(name)


def lora_replica(model: Path, venv: VLLMVenv, core: int, modules: dict[str, Path]) -> VLLMReplica:
    return VLLMReplica(
        model,
        venv=venv,
        served_model_names=(MODEL,),
        cpu_cores=str(core),
        extra_args=(
            "--enable-lora",
            "--max-lora-rank",
            str(RANK),
            "--max-loras",
            "3",
            "--lora-modules",
            *(f"{name}={path}" for name, path in sorted(modules.items())),
        ),
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
    )


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    venv = VLLMVenv().ensure()
    model = ensure_model(venv.python, model_folder())
    folder = tmp_path_factory.mktemp("adapters")
    adapters = {
        name: make_adapter(folder / name, seed=seed)
        for seed, name in enumerate(("only-a", "only-b", "both", "lazy"), start=1)
    }
    replicas = [
        lora_replica(model, venv, core, {name: adapters[name] for name in names})
        for core, names in enumerate(STARTED_WITH)
    ]
    config = folder / "gateway.yaml"
    config.write_text(
        f"lora_idle_unload: 4\nlora_adapters:\n  - {{name: lazy, path: {adapters['lazy']}}}\n"
    )
    with VLLMFleet(replicas) as fleet, GatewayProcess(fleet.urls, "--config", str(config)) as gw:
        wait_until(lambda: len(served_by(gw, "both")) == 2, "both replicas listed with `both`")
        yield Served(fleet.replicas, gw)


def backends(gateway: GatewayProcess) -> dict[str, dict[str, str]]:
    """The adapters each replica serves, by the replica's name, as /admin/backends shows."""
    listing = httpx.get(gateway.url + "/admin/backends", timeout=10).json()["data"]
    return {view["name"]: view["adapters"] for view in listing}


def served_by(gateway: GatewayProcess, adapter: str) -> list[str]:
    return [name for name, adapters in backends(gateway).items() if adapter in adapters]


def complete(gateway: GatewayProcess, model: str, prompt: str = PROMPT) -> httpx.Response:
    response = httpx.post(
        gateway.url + "/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 2},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    assert response.json()["model"] == model
    return response


def cached(response: httpx.Response) -> int:
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] or 0)


def predicted(gateway: GatewayProcess, model: str) -> float:
    return metric_value(gateway.metrics(), "gateway_matched_tokens_predicted_total", model=model)


def loads_of_lazy(served: Served) -> list[int]:
    """How many times each replica has logged loading `lazy`."""
    line = "Loaded new LoRA adapter: name 'lazy'"
    return [replica.log().count(line) for replica in served.replicas]


def test_each_replica_is_shown_with_its_own_adapters(served: Served) -> None:
    cards = httpx.get(served.gateway.url + "/v1/models", timeout=10).json()["data"]
    assert {card["id"]: card["parent"] for card in cards} == {
        MODEL: None,
        "only-a": MODEL,
        "only-b": MODEL,
        "both": MODEL,
        "lazy": MODEL,
    }
    shown = backends(served.gateway)
    for index, names in enumerate(STARTED_WITH):
        assert shown[served.name(index)] == dict.fromkeys(names, MODEL)


def test_each_request_reaches_a_replica_that_serves_its_adapter(served: Served) -> None:
    for index, adapter in enumerate(("only-a", "only-b")):
        homes = {
            complete(
                served.gateway, adapter, f"{adapter} asks question {number} about paint"
            ).headers["x-gateway-backend"]
            for number in range(3)
        }
        assert homes == {served.name(index)}


def test_an_adapter_repeat_hits_the_cache_and_the_base_model_shares_nothing(
    served: Served,
) -> None:
    gateway = served.gateway
    first = complete(gateway, "only-b")
    repeat = complete(gateway, "only-b")
    assert repeat.headers["x-gateway-backend"] == first.headers["x-gateway-backend"]
    assert cached(repeat) > 0
    assert predicted(gateway, "only-b") > 0
    # On the replica that holds it under `only-b`, the base model's same prompt is not cached...
    home = served.replicas[served.index(first.headers["x-gateway-backend"])]
    base = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    assert cached(httpx.post(home.url + "/v1/completions", json=base, timeout=120)) == 0
    # ...and the gateway predicts none of it for the base model.
    before = predicted(gateway, MODEL)
    complete(gateway, MODEL)
    assert predicted(gateway, MODEL) == before


def test_an_adapter_served_by_both_replicas_stays_on_one(served: Served) -> None:
    routes = [
        complete(served.gateway, "both", f"question {number} on a topic of its own, timber")
        for number in range(6)
    ]
    assert len({response.headers["x-gateway-backend"] for response in routes}) == 1
    assert {response.headers["x-gateway-route"] for response in routes} == {"adapter"}


def test_six_first_requests_load_a_declared_adapter_once(served: Served) -> None:
    gateway = served.gateway
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: complete(gateway, "lazy"), range(6)))
    (home,) = {answer.headers["x-gateway-backend"] for answer in answers}
    loads = loads_of_lazy(served)
    assert sorted(loads) == [0, 1]
    assert loads[served.index(home)] == 1
    text = gateway.metrics()
    assert metric_value(text, "gateway_lora_adapter_loads_total", adapter="lazy") == 1
    assert served_by(gateway, "lazy") == [home]
    reused = complete(gateway, "lazy")  # its prompt is cached under it where it was loaded
    assert reused.headers["x-gateway-backend"] == home
    assert cached(reused) > 0
    assert loads_of_lazy(served) == loads
    # Idle for lora_idle_unload seconds: unloaded from its replica.
    wait_until(lambda: not served_by(gateway, "lazy"), "`lazy` unloaded")
    listed = httpx.get(served.replicas[served.index(home)].url + "/v1/models", timeout=10).json()[
        "data"
    ]
    assert "lazy" not in {card["id"] for card in listed}
