"""Flow control (`--max-inflight-per-replica`), end to end: a gateway in front of replicas of the
test's own that hold each request until the test lets it go, so that what the gateway lets
through, and in which order, is read from the replicas by order alone."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from prefix_gateway.emulator.process import EmulatorProcess
from tests.holding_replica import HoldingReplica
from tests.support import PATIENCE_SECONDS, GatewayProcess, stall, wait_until

MODEL = "held-model"


@contextmanager
def fleet(
    count: int, tmp_path: Path, tenants: list[dict[str, Any]], *args: str
) -> Iterator[tuple[list[HoldingReplica], GatewayProcess]]:
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({"tenants": tenants}))
    with ExitStack() as stack:
        replicas = [stack.enter_context(HoldingReplica()) for _ in range(count)]
        specs = [f"{MODEL}={replica.url}" for replica in replicas]
        gateway = stack.enter_context(
            # The replicas hold requests by design, longer than a stall on a busy machine.
            GatewayProcess(
                specs,
                *("--config", str(config), "--queue-timeout", "300", "--stall-seconds", "3600"),
                *args,
            )
        )
        try:
            yield replicas, gateway
        finally:
            for replica in replicas:
                replica.release(100)  # whatever still waits is let go


class Clients:
    """Requests sent each from a thread of its own; their statuses kept."""

    def __init__(self, gateway: GatewayProcess) -> None:
        self._url = gateway.url + "/v1/chat/completions"
        self.statuses: dict[str, int] = {}
        self._threads: list[threading.Thread] = []

    def send(self, key: str, text: str) -> None:
        def run() -> None:
            body = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
            headers = {"authorization": f"Bearer {key}"}
            reply = httpx.post(self._url, json=body, headers=headers, timeout=300)
            self.statuses[text] = reply.status_code

        thread = threading.Thread(target=run)
        thread.start()
        self._threads.append(thread)

    def join(self) -> None:
        for thread in self._threads:
            thread.join(300)


def waiting(gateway: GatewayProcess) -> dict[str, int]:
    listed = httpx.get(gateway.url + "/admin/tenants", timeout=10).json()["data"]
    return {row["name"]: row["waiting"] for row in listed}


def arrived(replicas: list[HoldingReplica]) -> Callable[[], int]:
    return lambda: sum(len(replica.arrived) for replica in replicas)


def test_no_replica_gets_more_than_its_slots_and_the_rest_wait_in_the_gateway(
    tmp_path: Path,
) -> None:
    tenants = [{"name": "team", "api_key": "team-key"}]
    with fleet(2, tmp_path, tenants, "--max-inflight-per-replica", "2") as (replicas, gateway):
        clients = Clients(gateway)
        for number in range(7):
            clients.send("team-key", f"request {number}")
        wait_until(lambda: waiting(gateway) == {"team": 3}, "three requests waiting")
        wait_until(lambda: arrived(replicas)() == 4, "four requests at the replicas")
        assert [replica.held for replica in replicas] == [2, 2]
        # One slot frees: exactly one waiting request takes it.
        replicas[0].release()
        wait_until(lambda: waiting(gateway) == {"team": 2}, "one request dispatched")
        wait_until(lambda: arrived(replicas)() == 5, "the fifth request at a replica")
        assert sorted(replica.held for replica in replicas) == [2, 2]
        for replica in replicas:
            replica.release(10)
        clients.join()
    assert set(clients.statuses.values()) == {200} and len(clients.statuses) == 7


def queue_in_order(
    gateway: GatewayProcess, clients: Clients, sends: list[tuple[str, str, str]]
) -> None:
    """Send each (tenant, key, text) once the one before it is waiting in the gateway."""
    expected: dict[str, int] = {}
    for tenant, key, text in sends:
        clients.send(key, text)
        expected[tenant] = expected.get(tenant, 0) + 1
        want = dict(expected)
        wait_until(
            lambda want=want: {k: v for k, v in waiting(gateway).items() if v} == want,  # type: ignore[misc]
            f"{text} waiting",
        )


def serve_one_by_one(replica: HoldingReplica, count: int) -> list[str]:
    """Let the held requests go one at a time; the order the next `count` arrived in."""
    start = len(replica.arrived)
    for number in range(1, count + 1):
        replica.release()
        wait_until(lambda n=number: len(replica.arrived) >= start + n, "the next request")  # type: ignore[misc]
    return replica.arrived[start : start + count]


def test_a_higher_priority_goes_first_and_equal_tenants_share_in_turn(tmp_path: Path) -> None:
    tenants: list[dict[str, Any]] = [
        {"name": "batch-a", "api_key": "a-key"},
        {"name": "batch-b", "api_key": "b-key"},
        {"name": "urgent", "api_key": "u-key", "priority": 1},
    ]
    args = ("--max-inflight-per-replica", "1")
    with fleet(1, tmp_path, tenants, *args) as ([replica], gateway):
        clients = Clients(gateway)
        clients.send("a-key", "a0")  # holds the only slot
        wait_until(lambda: replica.arrived == ["a0"], "the first request at the replica")
        sends = [("batch-a", "a-key", f"a{n}") for n in range(1, 5)]
        sends += [("batch-b", "b-key", "b1"), ("batch-b", "b-key", "b2")]
        sends += [("urgent", "u-key", "u1")]
        queue_in_order(gateway, clients, sends)
        order = serve_one_by_one(replica, 7)
        replica.release(10)
        clients.join()
    # Priority first; then the two equal tenants take turns, each in its own order (batch-b
    # first: batch-a had a0 served already), and the one that queued more goes on alone once
    # the other has nothing waiting.
    assert order == ["u1", "b1", "a1", "b2", "a2", "a3", "a4"], order
    assert set(clients.statuses.values()) == {200}


def test_a_weight_of_two_gets_two_turns_for_one(tmp_path: Path) -> None:
    tenants: list[dict[str, Any]] = [
        {"name": "heavy", "api_key": "h-key", "weight": 2},
        {"name": "light", "api_key": "l-key"},
    ]
    with fleet(1, tmp_path, tenants, "--max-inflight-per-replica", "1") as ([replica], gateway):
        clients = Clients(gateway)
        clients.send("l-key", "l0")
        wait_until(lambda: replica.arrived == ["l0"], "the first request at the replica")
        sends = [("light", "l-key", f"l{n}") for n in range(1, 4)]
        sends += [("heavy", "h-key", f"h{n}") for n in range(1, 7)]
        queue_in_order(gateway, clients, sends)
        order = serve_one_by_one(replica, 9)
        replica.release(10)
        clients.join()
    heavy_first_six = [text for text in order[:6] if text.startswith("h")]
    assert len(heavy_first_six) == 4, order  # two of every three turns while both wait
    assert [text for text in order if text.startswith("l")] == ["l1", "l2", "l3"]


def test_a_wait_past_the_queue_timeout_is_a_429_that_says_so(tmp_path: Path) -> None:
    tenants = [{"name": "team", "api_key": "team-key"}]
    args = ("--max-inflight-per-replica", "1")
    with fleet(1, tmp_path, tenants, *args, "--queue-timeout", "1") as ([replica], gateway):
        clients = Clients(gateway)
        clients.send("team-key", "first")
        wait_until(lambda: replica.arrived == ["first"], "the first request at the replica")
        late = httpx.post(
            gateway.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "second"}]},
            headers={"authorization": "Bearer team-key"},
            timeout=60,
        )
        replica.release()
        clients.join()
    assert late.status_code == 429
    assert late.json()["error"]["code"] == "queue_timeout"
    assert late.headers["retry-after"] == "1"
    assert replica.arrived == ["first"] and clients.statuses == {"first": 200}


@pytest.mark.parametrize("cap", ["-1"])
def test_a_negative_cap_is_refused_at_start(cap: str) -> None:
    from prefix_gateway.config import ConfigError, load_settings

    with pytest.raises(ConfigError, match="max_inflight_per_replica"):
        load_settings(
            environ={"GATEWAY_BACKENDS": "http://a:1", "GATEWAY_MAX_INFLIGHT_PER_REPLICA": cap}
        )


def test_a_follow_up_waits_for_a_slot_on_the_replica_holding_its_response(
    tmp_path: Path,
) -> None:
    """A request naming a stored response goes through the queue like every other: it waits
    for a free slot on the replica that holds the response, never past the cap."""
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({"tenants": [{"name": "team", "api_key": "team-key"}]}))
    headers = {"authorization": "Bearer team-key"}
    with ExitStack() as stack:
        replica = stack.enter_context(EmulatorProcess("--decode-ms-per-token", "5"))
        gateway = stack.enter_context(
            GatewayProcess(
                [replica.url],
                *("--config", str(config), "--max-inflight-per-replica", "1"),
                *("--queue-timeout", "300", "--stall-seconds", "3600"),
            )
        )
        responses = gateway.url + "/v1/responses"
        model = "emulated-model"
        first = httpx.post(
            responses,
            json={"model": model, "input": "hi"},
            headers=headers,
            timeout=PATIENCE_SECONDS,
        )
        assert first.status_code == 200
        stall(replica, True)
        statuses: list[int] = []

        def send(body: dict[str, Any]) -> None:
            answer = httpx.post(responses, json=body, headers=headers, timeout=300)
            statuses.append(answer.status_code)

        holder = threading.Thread(target=send, args=({"model": model, "input": "hold it"},))
        holder.start()
        wait_until(lambda: gateway.metric("gateway_backend_in_flight") == 1, "the slot taken")
        follow = {"model": model, "input": "and then?", "previous_response_id": first.json()["id"]}
        follower = threading.Thread(target=send, args=(follow,))
        follower.start()
        wait_until(
            lambda: gateway.metric("gateway_requests_waiting", queue="flow") == 1,
            "the follow-up waiting in the queue",
        )
        assert replica.metric("vllm:num_requests_running") == 1
        stall(replica, False)
        holder.join(60)
        follower.join(60)
        assert statuses == [200, 200]


def test_an_adapter_loading_on_demand_holds_up_no_other_request(tmp_path: Path) -> None:
    """The load is the adapter request's own wait: a request for the base model, sent while
    the load runs, is answered before it ends."""
    config = tmp_path / "gateway.yaml"
    config.write_text("lora_adapters:\n  - {name: lazy, path: /a/lazy}\n")
    with ExitStack() as stack:
        replica = stack.enter_context(
            EmulatorProcess("--enable-lora", "--lora-load-ms", "8000", "--max-loras", "1")
        )
        gateway = stack.enter_context(
            GatewayProcess(
                [replica.url],
                *("--config", str(config), "--max-inflight-per-replica", "4"),
                *("--queue-timeout", "300"),
            )
        )
        url = gateway.url + "/v1/completions"
        adapter: list[int] = []
        loading = threading.Thread(
            target=lambda: adapter.append(
                httpx.post(
                    url, json={"model": "lazy", "prompt": "x", "max_tokens": 2}, timeout=120
                ).status_code
            )
        )
        loading.start()
        wait_until(
            lambda: replica.metric("emulator:lora_loads_running") == 1, "the adapter loading"
        )
        base = httpx.post(
            url, json={"model": "emulated-model", "prompt": "y", "max_tokens": 2}, timeout=120
        )
        loads_done = replica.metric("emulator:lora_loads_total")
        loading.join(120)
    assert base.status_code == 200 and adapter == [200]
    assert loads_done == 0  # answered while the adapter was still loading
