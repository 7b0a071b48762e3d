"""LoRA adapters through a real gateway in front of emulated replicas that serve them: shown
apart from base models, kept on few replicas, keyed apart in the index, loaded on demand once
and unloaded when idle."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from prefix_gateway.config import ConfigError, Settings, add_arguments, load_settings
from prefix_gateway.config.adapters import AdapterSpec, parse_adapters
from prefix_gateway.emulator.process import EmulatorProcess
from prefix_gateway.processes import metric_value
from prefix_gateway.prompt.hashing import key_hash
from prefix_gateway.replay.report import render_table, summarise
from prefix_gateway.replay.simulator import ReplayConfig, run_replay
from prefix_gateway.replay.synthetic import synthetic_trace
from prefix_gateway.routing.prefix_policy import PrefixPolicy
from prefix_gateway.routing.types import Route, RoutingState
from tests.support import PATIENCE_SECONDS, GatewayProcess, wait_until

MODEL = "emulated-model"
OTHER_MODEL = "other-model"
IDLE_SECONDS = 3
# Both replicas serve `both`; only the first serves `only-a`; `lazy`, `unasked` and `idle` are
# declared to the gateway and served by no replica at first (`unasked` is never asked for). A
# load takes a while, so that the first requests for an adapter all arrive while it runs. A
# third replica serves another base model without LoRA (its load endpoint is a 404, as vLLM's
# without runtime updating): the declared `broken` can only be loaded there.
COMMON = ["--enable-lora", "--lora-load-ms", "300", "--max-loras", "1"]


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[EmulatorProcess]]:
    first = EmulatorProcess(*COMMON, "--lora-modules", "both=/a/both", "only-a=/a/only-a")
    second = EmulatorProcess(*COMMON, "--seed", "1", "--lora-modules", "both=/a/both")
    third = EmulatorProcess(name=OTHER_MODEL)
    with first, second, third:
        yield [first, second, third]


def declared_adapters(folder: Path) -> Path:
    config = folder / "gateway.yaml"
    config.write_text(
        f"lora_idle_unload: {IDLE_SECONDS}\n"
        "lora_adapters:\n"
        "  - {name: lazy, path: /a/lazy}\n"
        "  - {name: unasked, path: /a/unasked}\n"
        "  - {name: idle, path: /a/idle, base_model: emulated-model}\n"
        f"  - {{name: broken, path: /a/broken, base_model: {OTHER_MODEL}}}\n"
    )
    return config


@contextlib.contextmanager
def gateway_before(replicas: list[EmulatorProcess], config: Path) -> Iterator[GatewayProcess]:
    with GatewayProcess([replica.url for replica in replicas], "--config", str(config)) as started:
        wait_until(lambda: len(served_by(started, "both")) == 2, "both replicas listed")
        yield started


@pytest.fixture(scope="module")
def gateway(
    replicas: list[EmulatorProcess], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    with gateway_before(replicas, declared_adapters(tmp_path_factory.mktemp("lora"))) as started:
        yield started


@pytest.fixture
def unused_gateway(replicas: list[EmulatorProcess], tmp_path: Path) -> Iterator[GatewayProcess]:
    """A gateway of its own that has routed nothing yet: the module's counts recent requests
    of other tests, which make a replica hot and move where requests go."""
    with gateway_before(replicas, declared_adapters(tmp_path)) as started:
        yield started


def served_by(gateway: GatewayProcess, adapter: str) -> list[str]:
    listing = httpx.get(gateway.url + "/admin/backends", timeout=10).json()["data"]
    return [item["name"] for item in listing if adapter in item["adapters"] and item["healthy"]]


def complete(gateway: GatewayProcess, model: str, prompt: str) -> httpx.Response:
    response = httpx.post(
        gateway.url + "/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 2},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    assert response.json()["model"] == model
    return response


def cached_tokens(response: httpx.Response) -> int:
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def name_of(replica: EmulatorProcess) -> str:
    return replica.url.removeprefix("http://")


def test_adapters_are_shown_apart_from_base_models(
    gateway: GatewayProcess, replicas: list[EmulatorProcess]
) -> None:
    models = httpx.get(gateway.url + "/v1/models", timeout=10).json()["data"]
    parents = {card["id"]: card["parent"] for card in models}
    # `unasked` is served by nobody: listed all the same. It names no base model and the fleet
    # has two: its parent is unknown until it loads (as `lazy`'s, until another test asks).
    assert parents.pop("lazy") in (None, MODEL)
    assert parents == {
        MODEL: None,
        OTHER_MODEL: None,
        "both": MODEL,
        "only-a": MODEL,
        "unasked": None,
        "idle": MODEL,
        "broken": OTHER_MODEL,
    }
    listing = httpx.get(gateway.url + "/admin/backends", timeout=10).json()["data"]
    views = {item["name"]: item for item in listing}
    first, second, _ = (views[name_of(replica)] for replica in replicas)
    assert first["models"] == second["models"] == [MODEL]
    # What each started with (others may have loaded the declared ones since).
    assert first["adapters"].items() >= {"both": MODEL, "only-a": MODEL}.items()
    assert second["adapters"].items() >= {"both": MODEL}.items()
    assert "only-a" not in second["adapters"]
    assert "unasked" not in first["adapters"] | second["adapters"]
    metrics = gateway.metrics()
    assert metric_value(metrics, "gateway_lora_adapter_replicas", adapter="both") == 2
    assert metric_value(metrics, "gateway_lora_adapter_replicas", adapter="only-a") == 1
    assert metric_value(metrics, "gateway_lora_adapter_replicas", adapter="unasked") == 0


def test_an_adapter_stays_on_one_replica_while_its_load_allows(
    unused_gateway: GatewayProcess, replicas: list[EmulatorProcess]
) -> None:
    gateway = unused_gateway
    routes = [
        complete(gateway, "both", f"question number {number} about something else entirely")
        for number in range(8)
    ]
    backends = {response.headers["x-gateway-backend"] for response in routes}
    assert len(backends) == 1
    assert {response.headers["x-gateway-route"] for response in routes} == {"adapter"}
    # The base model's distinct prompts spread by their own keys, over both replicas.
    spread = {
        complete(gateway, MODEL, f"a different question {number} on its own topic").headers[
            "x-gateway-backend"
        ]
        for number in range(12)
    }
    assert spread == {name_of(replica) for replica in replicas[:2]}
    # An adapter served by one replica only goes there.
    only = {
        complete(gateway, "only-a", f"ask {number}").headers["x-gateway-backend"]
        for number in range(4)
    }
    assert only == {name_of(replicas[0])}


def test_a_prompt_cached_under_one_adapter_is_not_predicted_for_another(
    gateway: GatewayProcess,
) -> None:
    prompt = "the same long prompt under every adapter, " * 12
    complete(gateway, "only-a", prompt)
    repeat = complete(gateway, "only-a", prompt)
    assert cached_tokens(repeat) > 0
    metrics = gateway.metrics()
    assert metric_value(metrics, "gateway_matched_tokens_predicted_total", model="only-a") > 0
    # Same prompt, same replica, other adapter or the base model: nothing cached, none predicted.
    for model in ("both", MODEL):
        before = metric_value(
            gateway.metrics(), "gateway_matched_tokens_predicted_total", model=model
        )
        other = complete(gateway, model, prompt)
        assert cached_tokens(other) == 0
        after = metric_value(
            gateway.metrics(), "gateway_matched_tokens_predicted_total", model=model
        )
        assert after == before


def test_a_declared_adapter_is_loaded_once_for_concurrent_first_requests(
    gateway: GatewayProcess, replicas: list[EmulatorProcess]
) -> None:
    def loads() -> dict[str, float]:
        return {
            name_of(replica): replica.metric("emulator:lora_loads_total") for replica in replicas
        }

    before = loads()
    with ThreadPoolExecutor(6) as pool:
        answers = list(
            pool.map(lambda number: complete(gateway, "lazy", f"first call {number}"), range(6))
        )
    homes = {answer.headers["x-gateway-backend"] for answer in answers}
    assert len(homes) == 1
    made = {name: count - before[name] for name, count in loads().items()}
    assert sorted(made.values()) == [0, 0, 1]
    (home,) = homes
    assert made[home] == 1
    assert served_by(gateway, "lazy") == [home]
    # Reused: the next request goes there, and nothing is loaded again.
    assert complete(gateway, "lazy", "a later call").headers["x-gateway-backend"] == home
    assert sum(loads().values()) - sum(before.values()) == 1
    metrics = gateway.metrics()
    loaded = metric_value(
        metrics, "gateway_lora_adapter_loads_total", adapter="lazy", outcome="loaded"
    )
    assert loaded == 1
    # Whatever it tried first (the replica without LoRA may refuse), its base model now.
    listed = httpx.get(gateway.url + "/v1/models", timeout=10).json()["data"]
    assert {card["id"]: card["parent"] for card in listed}["lazy"] == MODEL


def test_an_idle_adapter_is_unloaded_and_loaded_again_when_asked_for(
    gateway: GatewayProcess, replicas: list[EmulatorProcess]
) -> None:
    home = complete(gateway, "idle", "once").headers["x-gateway-backend"]
    assert served_by(gateway, "idle") == [home]

    def unloaded() -> float:
        text = gateway.metrics()
        return metric_value(
            text, "gateway_lora_adapter_unloads_total", adapter="idle", outcome="unloaded"
        )

    wait_until(lambda: unloaded() == 1, "the idle adapter unloaded")
    assert served_by(gateway, "idle") == []
    (replica,) = (replica for replica in replicas if name_of(replica) == home)
    listed = httpx.get(replica.url + "/v1/models", timeout=10).json()["data"]
    assert "idle" not in {card["id"] for card in listed}
    complete(gateway, "idle", "again")
    loads = metric_value(
        gateway.metrics(), "gateway_lora_adapter_loads_total", adapter="idle", outcome="loaded"
    )
    assert loads == 2


def test_an_adapter_no_replica_loads_is_unavailable_and_not_tried_again_at_once(
    gateway: GatewayProcess,
) -> None:
    def ask() -> httpx.Response:
        body = {"model": "broken", "prompt": "anything", "max_tokens": 2}
        return httpx.post(gateway.url + "/v1/completions", json=body, timeout=30)

    for _ in range(3):
        answer = ask()
        assert answer.status_code == 503
        error = answer.json()["error"]
        assert error["code"] == "adapter_unavailable"
        assert error["message"].startswith("adapter unavailable")
        # What the replica said (its 404, the adapter's path) stays in the gateway's log.
        assert "404" not in error["message"] and "/a/broken" not in error["message"]
        assert int(answer.headers["retry-after"]) >= 1
        # One load tried: the later requests are answered from the remembered failure.
        failed = metric_value(
            gateway.metrics(),
            "gateway_lora_adapter_loads_total",
            adapter="broken",
            outcome="failed",
        )
        assert failed == 1


def test_the_emulated_replica_swaps_loads_and_unloads_as_vllm_does(
    replicas: list[EmulatorProcess],
) -> None:
    replica = replicas[0]  # serves `both` and `only-a`, one slot

    def ask(model: str) -> None:
        body = {"model": model, "prompt": "slot check", "max_tokens": 1}
        answer = httpx.post(replica.url + "/v1/completions", json=body, timeout=30)
        assert answer.status_code == 200 and answer.json()["model"] == model

    ask("only-a")
    before = replica.metric("emulator:lora_swaps_total")
    for model in ("only-a", "both", "both", "only-a", MODEL):
        ask(model)
    assert replica.metric("emulator:lora_swaps_total") == before + 2  # the base model needs none
    load = {"lora_name": "extra", "lora_path": "/a/extra"}
    first = httpx.post(replica.url + "/v1/load_lora_adapter", json=load, timeout=10)
    assert (first.status_code, first.text) == (
        200,
        "Success: LoRA adapter 'extra' added successfully.",
    )
    again = httpx.post(replica.url + "/v1/load_lora_adapter", json=load, timeout=10)
    assert again.status_code == 400 and again.json()["error"]["type"] == "InvalidUserInput"
    cards = httpx.get(replica.url + "/v1/models", timeout=10).json()["data"]
    assert {"id": "extra", "root": "/a/extra", "parent": MODEL}.items() <= cards[-1].items()
    unload = {"lora_name": "extra"}
    assert (
        httpx.post(
            replica.url + "/v1/unload_lora_adapter", json=unload, timeout=PATIENCE_SECONDS
        ).status_code
        == 200
    )
    gone = httpx.post(
        replica.url + "/v1/unload_lora_adapter", json=unload, timeout=PATIENCE_SECONDS
    )
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "NotFoundError"
    # Without LoRA, as vLLM without runtime updating: no such endpoint.
    plain = httpx.post(replicas[2].url + "/v1/load_lora_adapter", json=load, timeout=10)
    assert plain.status_code == 404


def test_the_adapters_list_is_checked_at_start() -> None:
    assert parse_adapters([{"name": "a", "path": "/p"}]) == (AdapterSpec("a", "/p"),)
    bad = [
        ("not a list", "must be a list"),
        ([{"name": "a"}], "path must be"),
        ([{"name": "a b", "path": "/p"}], "name must be"),
        ([{"name": "a", "path": "/p", "weight": 1}], "unknown fields"),
        ([{"name": "a", "path": "/p"}, {"name": "a", "path": "/q"}], "given twice"),
        ([{"name": "a", "path": "/p", "base_model": "a"}], "its own base model"),
    ]
    for raw, message in bad:
        with pytest.raises(ConfigError, match=message):
            parse_adapters(raw)


def test_the_adapters_list_is_read_from_the_config_file(tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text("lora_adapters:\n  - {name: lazy, path: /a/lazy}\nlora_idle_unload: 60\n")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    settings = load_settings(parser.parse_args(["--config", str(config), "--backend", "a:1"]), {})
    assert settings.lora_adapters == (AdapterSpec("lazy", "/a/lazy"),)
    assert settings.lora_idle_unload == 60
    config.write_text("lora_adapters:\n  - {name: lazy}\n")
    with pytest.raises(ConfigError, match=r"lora_adapters\[0\] \(lazy\): path must be"):
        load_settings(parser.parse_args(["--config", str(config), "--backend", "a:1"]), {})


def test_the_policy_keys_an_adapter_on_its_name_until_the_bound_moves_it() -> None:
    policy = PrefixPolicy(Settings())
    names = [f"replica-{number}" for number in range(4)]
    adapter = key_hash("sql-lora")

    def choose(affinity_key: int, loads: dict[str, int]) -> tuple[str, Route]:
        state = RoutingState(
            candidates=names, loads=loads, affinity_key=affinity_key, adapter_key=adapter
        )
        decision = policy.choose(state)
        return decision.backend, decision.route

    idle = dict.fromkeys(names, 0)
    keys = [key_hash(f"prompt {number}") for number in range(50)]
    homes = {choose(key, idle) for key in keys}
    assert len(homes) == 1  # whatever the prompt: the adapter's replica
    ((home, route),) = homes
    assert route is Route.ADAPTER
    # Its replica at the bound (floor 2, 2 in flight of 2 in all): the next on the ring.
    busy = {**idle, home: 2}
    spill, route = choose(keys[0], busy)
    assert spill != home and route is Route.ADAPTER
    # Without an adapter, the prompts' own keys spread over the replicas.
    spread = {
        policy.choose(RoutingState(candidates=names, loads=idle, affinity_key=key)).backend
        for key in keys
    }
    assert len(spread) == len(names)


def test_the_replay_counts_fewer_swaps_with_adapter_affinity() -> None:
    trace = synthetic_trace("customers", 1, adapters=8, limit=160)
    assert {request.adapter for request in trace.requests} >= {"adapter-0", "adapter-1"}
    config = ReplayConfig(replicas=4, cache_tokens=16_384, max_loras=2)
    prefix = summarise(run_replay(trace, "prefix", config))
    rotated = summarise(run_replay(trace, "round_robin", config))
    assert prefix.adapters == rotated.adapters == 8
    assert "adapter" in prefix.routes
    assert prefix.swaps < rotated.swaps / 2
    assert prefix.replicas_per_adapter < rotated.replicas_per_adapter
    assert "| prefix | 8 |" in render_table("adapters", [prefix, rotated])
