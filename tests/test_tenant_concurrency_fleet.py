"""A tenant's `max_concurrency` across a fleet: three gateway processes with one `tenants:`
file share one redis-server in front of a replica that holds every request until the test lets
it go, so what is in flight is read from the replica and from Redis, by order alone. The fleet
holds exactly the cap, whichever gateway is asked; a release frees a slot on another gateway;
a gateway killed with requests in flight gives its slots back once its counts' time-to-live has
passed; with Redis killed each gateway holds its share and answers every request, and with
Redis back the counts are re-published. Each test has a tenant of its own; the gateway killed
is one more, started for it, and the test that kills Redis starts it again.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
import redis
import yaml

from tests.holding_replica import HoldingReplica
from tests.redis_server import PATIENT, RedisServer
from tests.support import GatewayProcess, gateways_on_redis, wait_until

pytestmark = pytest.mark.fleet

MODEL = "held-model"
GATEWAYS = 3
TENANTS: list[dict[str, Any]] = [
    {"name": name, "api_key": f"{name}-key", "max_concurrency": 2}
    for name in ("capped", "crashed", "outage")
]
# Seconds a gateway's counts stand in Redis: short, so that a dead gateway's slots come back
# within the test's patience.
TTL = "3"


@dataclass
class Fleet:
    redis: RedisServer
    replica: HoldingReplica
    gateways: list[GatewayProcess]
    args: tuple[str, ...]
    """The gateways' flags but `--redis-url` and their backends."""

    def another_gateway(self) -> GatewayProcess:
        """One more gateway like the others, on the same Redis."""
        backends = [f"{MODEL}={self.replica.url}"]
        return GatewayProcess(backends, "--redis-url", self.redis.url, *self.args)

    def in_flight(self, tenant: str) -> dict[str, int]:
        """The tenant's counts in Redis, per gateway process id."""
        with redis.Redis.from_url(self.redis.url) as client:
            stored: dict[bytes, bytes] = client.hgetall(f"pgw:t:{{{tenant}}}:in_flight")
        return {field.decode(): int(value.split()[-1]) for field, value in stored.items()}

    def total(self, name: str, **labels: str) -> float:
        """`name`'s samples with `labels`, summed over the gateways alive."""
        return sum(gateway.metric(name, **labels) for gateway in self.gateways)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    config = tmp_path_factory.mktemp("slots") / "tenants.yaml"
    config.write_text(yaml.safe_dump({"tenants": TENANTS}))
    # The replica holds requests for as long as a test wants: not a stall.
    args = ("--config", str(config), "--tenant-slots-ttl", TTL, "--stall-seconds", "600", *PATIENT)
    with HoldingReplica() as replica, RedisServer() as server:
        backends = [f"{MODEL}={replica.url}"]
        with gateways_on_redis(GATEWAYS, backends, server.url, *args) as started:
            try:
                yield Fleet(server, replica, list(started), args)
            finally:
                replica.release(100)  # whatever still waits is let go


class Held:
    """Requests sent each from a thread of its own, held by the replica; their statuses kept."""

    def __init__(self, replica: HoldingReplica) -> None:
        self._replica = replica
        self.statuses: dict[str, int] = {}
        self._threads: list[threading.Thread] = []

    def send(self, gateway: GatewayProcess, key: str, text: str) -> None:
        """Send `text` and wait until the replica holds it."""

        def run() -> None:
            body = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
            headers = {"authorization": f"Bearer {key}"}
            url = gateway.url + "/v1/chat/completions"
            try:
                reply = httpx.post(url, json=body, headers=headers, timeout=120)
            except httpx.TransportError:
                self.statuses[text] = 0  # its gateway was killed
            else:
                self.statuses[text] = reply.status_code

        thread = threading.Thread(target=run)
        thread.start()
        self._threads.append(thread)
        wait_until(lambda: text in self._replica.arrived, f"{text} held by the replica")

    def join(self) -> None:
        for thread in self._threads:
            thread.join(120)


def refused(gateway: GatewayProcess, key: str) -> openai.RateLimitError:
    """The official client's refusal of one more request (a request admitted instead would be
    held, and fail the test at its timeout)."""
    api = openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0, timeout=60)
    try:
        with pytest.raises(openai.RateLimitError) as caught:
            api.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "one too many"}]
            )
    finally:
        api.close()
    refusal = caught.value
    assert refusal.code == "rate_limit_exceeded"
    assert int(refusal.response.headers["retry-after"]) >= 1
    return refusal


def test_the_cap_is_the_fleets_and_a_release_frees_a_slot_elsewhere(fleet: Fleet) -> None:
    gateways, replica = fleet.gateways, fleet.replica
    held = Held(replica)
    held.send(gateways[0], "capped-key", "c0")
    held.send(gateways[1], "capped-key", "c1")
    assert sorted(fleet.in_flight("capped").values()) == [1, 1]
    # Full across the fleet: the third is refused whichever gateway is asked.
    refusals_before = fleet.total("gateway_tenant_refusals_total", tenant="capped")
    for gateway in gateways:
        refusal = refused(gateway, "capped-key")
        assert "2 requests in flight across the fleet" in refusal.message
    refusals = fleet.total("gateway_tenant_refusals_total", tenant="capped") - refusals_before
    assert refusals == GATEWAYS
    assert replica.held == 2
    # c0 ends at the first gateway; the third gateway may take its slot once that is written.
    replica.release()
    wait_until(lambda: held.statuses.get("c0") == 200, "c0 answered")
    wait_until(lambda: sum(fleet.in_flight("capped").values()) == 1, "c0's slot given back")
    held.send(gateways[2], "capped-key", "c2")
    assert replica.held == 2
    refused(gateways[0], "capped-key")
    replica.release(2)
    held.join()
    assert held.statuses == {"c0": 200, "c1": 200, "c2": 200}
    wait_until(lambda: not fleet.in_flight("capped"), "every count back to none")


def test_a_killed_gateways_slots_come_back_after_their_time_to_live(fleet: Fleet) -> None:
    replica, alive = fleet.replica, fleet.gateways[:2]
    held = Held(replica)
    with fleet.another_gateway() as dying:
        wait_until(lambda: dying.metric("gateway_redis_up") == 1, "the gateway on Redis")
        held.send(dying, "crashed-key", "d0")
        held.send(dying, "crashed-key", "d1")
        assert list(fleet.in_flight("crashed").values()) == [2]
        refused(alive[0], "crashed-key")
        dying.kill()  # SIGKILL with both requests in flight: no release is ever written
    # Its counts stand until their time-to-live has passed with no heartbeat, then count no
    # more: the live gateways take both slots, and no more.
    wait_until(lambda: not fleet.in_flight("crashed"), "the dead gateway's count expired")
    held.send(alive[0], "crashed-key", "d2")
    held.send(alive[1], "crashed-key", "d3")
    assert "2 requests in flight across the fleet" in refused(alive[0], "crashed-key").message
    replica.release(4)  # the dead gateway's two first: the replica answers in order
    held.join()
    assert held.statuses == {"d0": 0, "d1": 0, "d2": 200, "d3": 200}


def test_with_redis_killed_each_gateway_holds_its_share_and_counts_return_with_it(
    fleet: Fleet,
) -> None:
    gateways, replica = fleet.gateways[:2], fleet.replica
    fell_back = "gateway_redis_fallbacks_total"
    before = fleet.total(fell_back, operation="tenant_concurrency")
    served = "gateway_tenant_requests_total"
    served_before = fleet.total(served, tenant="outage", status="200")
    fleet.redis.kill()  # SIGKILL: every count it held is lost
    held = Held(replica)
    try:
        # A cap of 2 over the gateways last seen (three, or four with one killed lately): a
        # share of 1 each.
        held.send(gateways[0], "outage-key", "e0")
        refusal = refused(gateways[0], "outage-key")
        assert "its share of its limit of 2" in refusal.message
        held.send(gateways[1], "outage-key", "e1")
        assert fleet.total(fell_back, operation="tenant_concurrency") - before == 3
    finally:
        # Redis back, empty: each gateway writes its live count again, and the cap is the
        # fleet's once more.
        fleet.redis.start()
        wait_until(lambda: fleet.total("gateway_redis_up") == GATEWAYS, "back on Redis")
    wait_until(lambda: sorted(fleet.in_flight("outage").values()) == [1, 1], "counts re-published")
    for gateway in fleet.gateways:
        # A connection the restart broke may still fail one call, which the share answers
        # (refused as well: each share is full); the next goes to Redis.
        wait_until(
            lambda gateway=gateway: "across the fleet" in refused(gateway, "outage-key").message,  # type: ignore[misc]
            "refused by the fleet's count",
        )
    replica.release(2)
    held.join()
    assert held.statuses == {"e0": 200, "e1": 200}
    assert fleet.total(served, tenant="outage", status="200") - served_before == 2
