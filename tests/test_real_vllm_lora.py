"""LoRA adapters through the gateway in front of two real vLLM replicas (CPU build, the tiny
model, `--enable-lora`, runtime LoRA updating): the session's replicas, shared with the other
real-vLLM module (tests/real_fleet.py), with random-weight adapters: `only-a` served by the
first replica alone, `only-b` by the second alone, `both` by both, and `lazy` declared in
`lora_adapters` for this module's gateway to load where its policy picks.

`pytest --skip-real-vllm` (or SKIP_REAL_VLLM=1) skips it.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.real_fleet import MODEL, ONLY, STARTED_WITH, RealFleet, RealReplicas
from tests.support import GatewayProcess, metric_value, wait_until

pytestmark = pytest.mark.real_vllm

PROMPT = "the hammer and the drill are kept on the shelf by the timber and the paint " * 8


@pytest.fixture(scope="module")
def served(
    real_replicas: RealReplicas, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealFleet]:
    config = tmp_path_factory.mktemp("adapters") / "gateway.yaml"
    lazy = real_replicas.adapters["lazy"]
    # Its base named: the replicas serve several base models' names (tests/real_fleet.py).
    config.write_text(
        "lora_idle_unload: 4\nlora_adapters:\n"
        f"  - {{name: lazy, path: {lazy}, base_model: {MODEL}}}\n"
    )
    with GatewayProcess(real_replicas.urls, "--config", str(config)) as gw:
        wait_until(lambda: len(served_by(gw, "both")) == 2, "both replicas listed with `both`")
        yield RealFleet(real_replicas, gw)


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


def loads_of_lazy(served: RealFleet) -> list[int]:
    """How many times each replica has logged loading `lazy`."""
    line = "Loaded new LoRA adapter: name 'lazy'"
    return [replica.log().count(line) for replica in served.replicas]


def test_each_replica_is_shown_with_its_own_adapters(served: RealFleet) -> None:
    cards = httpx.get(served.gateway.url + "/v1/models", timeout=10).json()["data"]
    assert {card["id"]: card["parent"] for card in cards} == {
        MODEL: None,
        **dict.fromkeys(ONLY),
        "only-a": MODEL,
        "only-b": MODEL,
        "both": MODEL,
        "lazy": MODEL,
    }
    shown = backends(served.gateway)
    for index, names in enumerate(STARTED_WITH):
        assert shown[served.name(index)] == dict.fromkeys(names, MODEL)


def test_each_request_reaches_a_replica_that_serves_its_adapter(served: RealFleet) -> None:
    for index, adapter in enumerate(("only-a", "only-b")):
        homes = {
            complete(
                served.gateway, adapter, f"{adapter} asks question {number} about paint"
            ).headers["x-gateway-backend"]
            for number in range(3)
        }
        assert homes == {served.name(index)}


def test_an_adapter_repeat_hits_the_cache_and_the_base_model_shares_nothing(
    served: RealFleet,
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


def test_an_adapter_served_by_both_replicas_stays_on_one(served: RealFleet) -> None:
    routes = [
        complete(served.gateway, "both", f"question {number} on a topic of its own, timber")
        for number in range(6)
    ]
    assert len({response.headers["x-gateway-backend"] for response in routes}) == 1
    assert {response.headers["x-gateway-route"] for response in routes} == {"adapter"}


def test_six_first_requests_load_a_declared_adapter_once(served: RealFleet) -> None:
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
