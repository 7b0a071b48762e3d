"""Stalled replicas: alive to /health, producing nothing; found from progress, not probes."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import orjson
import pytest

from prefix_gateway.backends.backend import Work
from prefix_gateway.backends.health import Health
from prefix_gateway.backends.pool import BackendPool
from prefix_gateway.backends.prefill_speed import PrefillSpeed
from prefix_gateway.backends.stalls import StallRule, StallWatch
from prefix_gateway.emulator.replicas import EmulatedReplicas
from prefix_gateway.metrics import Metrics
from tests.support import PATIENCE_SECONDS, GatewayProcess, metric_value, wait_until

MODEL = "emulated-model"
RULE = StallRule(min_seconds=3.0, factor=4.0)


@dataclass(eq=False)
class Waiting:
    sent_at: float
    blocks_ahead: int = 1
    first_byte_at: float = 0.0
    awaiting_client: bool = False
    judged_from: float = field(init=False)

    def __post_init__(self) -> None:
        self.judged_from = self.sent_at

    def stop(self) -> None:
        return None


def test_a_replica_is_stalled_only_when_it_waits_long_and_produces_nothing() -> None:
    speed = PrefillSpeed(guess_blocks_per_second=100.0)
    waiting: set[Work] = {Waiting(sent_at=100.0)}
    assert RULE.verdict(102.0, waiting, progressed_at=90.0, speed=speed) is None  # not yet
    assert RULE.verdict(104.0, waiting, progressed_at=90.0, speed=speed) is not None
    # Something produced lately: busy, not stuck; silent since then for long: stuck.
    assert RULE.verdict(104.0, waiting, progressed_at=101.5, speed=speed) is None
    assert RULE.verdict(105.0, waiting, progressed_at=101.5, speed=speed) is not None
    # Nothing on it: nothing to judge; a stream of ours gone silent is judged too.
    assert RULE.verdict(104.0, set(), progressed_at=90.0, speed=speed) is None
    streaming: set[Work] = {Waiting(100.0, first_byte_at=1.0)}
    assert RULE.verdict(104.0, streaming, progressed_at=101.5, speed=speed) is None
    assert RULE.verdict(105.0, streaming, progressed_at=101.5, speed=speed) is not None


def test_a_stream_waiting_on_its_client_is_no_evidence_against_its_replica() -> None:
    speed = PrefillSpeed(guess_blocks_per_second=100.0)
    blocked = Waiting(sent_at=100.0, first_byte_at=1.0, awaiting_client=True)
    # Its client has not read for long: the replica could send nothing, and is not judged.
    assert RULE.verdict(200.0, {blocked}, progressed_at=101.0, speed=speed) is None
    # Once the client takes the chunk, the replica's silence counts from then, not before.
    blocked.awaiting_client, blocked.judged_from = False, 199.0
    assert RULE.verdict(201.0, {blocked}, progressed_at=101.0, speed=speed) is None
    assert RULE.verdict(203.0, {blocked}, progressed_at=101.0, speed=speed) is not None
    # Beside it, a request that waits for its first byte is judged as ever.
    blocked.awaiting_client = True
    waiting = Waiting(sent_at=150.0)
    assert RULE.verdict(152.0, {blocked, waiting}, progressed_at=101.0, speed=speed) is None
    assert RULE.verdict(154.0, {blocked, waiting}, progressed_at=101.0, speed=speed) is not None


def test_without_a_stream_to_show_progress_the_engine_counter_gets_its_lag() -> None:
    speed = PrefillSpeed(guess_blocks_per_second=100.0)
    lagging = StallRule(min_seconds=3.0, factor=4.0, scrape_lag=4.0)
    alone: set[Work] = {Waiting(sent_at=100.0)}
    assert lagging.verdict(105.0, alone, progressed_at=90.0, speed=speed) is None
    assert lagging.verdict(108.0, alone, progressed_at=90.0, speed=speed) is not None
    # A stream of ours running there would have shown progress as it happened.
    streaming = {*alone, Waiting(sent_at=95.0, first_byte_at=1.0)}
    assert lagging.verdict(105.0, streaming, progressed_at=90.0, speed=speed) is not None


def test_a_long_prefill_is_given_the_time_its_size_needs() -> None:
    speed = PrefillSpeed(guess_blocks_per_second=100.0)
    for _ in range(50):
        speed.observe(blocks=20, seconds=0.02)  # the fleet prefills 1,000 blocks a second
    assert 900 < speed.blocks_per_second < 1_100
    long: set[Work] = {Waiting(sent_at=100.0, blocks_ahead=6_000)}  # ~6 s of prefill
    assert RULE.verdict(110.0, long, progressed_at=90.0, speed=speed) is None
    assert RULE.verdict(130.0, long, progressed_at=90.0, speed=speed) is not None


def test_the_watch_judges_the_progress_its_backend_was_told_of() -> None:
    pool = BackendPool.from_specs([f"{MODEL}=http://a:1"])
    backend = pool.backends[0]
    pool.set_health(backend, True)
    health = Health(pool, unhealthy_threshold=2, healthy_threshold=2, failure_threshold=3)
    watch = StallWatch(pool, health, RULE, Metrics(), block_tokens=16)
    waiting = Waiting(sent_at=100.0)
    backend.attempt_sent(waiting)
    backend.progressed(101.5)
    backend.generated_since(95.0)  # an engine's tokens counted since an earlier scrape
    assert backend.progressed_at == 101.5
    assert watch.check(104.0) == []
    assert watch.check(105.0) == [backend]
    assert backend.stalled and not backend.healthy and pool.serving(MODEL) is None
    backend.attempt_ended(waiting)
    health.probed(backend, True)  # `/health` says nothing of a stalled engine
    health.probed(backend, True)
    assert not backend.healthy
    health.inference_probed(backend, True)
    assert backend.healthy and not backend.stalled and not backend.ejected
    assert backend.probe_streak == 1 and pool.serving(MODEL) is not None


def chat(
    url: str, tag: str, stream: bool = True, tokens: int = 8, **extra: object
) -> httpx.Response:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"{tag} please answer"}],
        "max_tokens": tokens,
        "stream": stream,
        **extra,
    }
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as response:
        response.read()
        return response


def stall(replica_url: str, stalled: bool) -> None:
    answer = httpx.post(
        replica_url + "/emulator/stall", json={"stalled": stalled}, timeout=PATIENCE_SECONDS
    )
    assert answer.status_code == 200


@pytest.fixture
def replicas() -> Iterator[EmulatedReplicas]:
    with EmulatedReplicas(3, MODEL, ["--decode-ms-per-token", "2"]) as started:
        yield started


def backends(gateway: GatewayProcess) -> dict[str, dict[str, object]]:
    listing = httpx.get(gateway.url + "/admin/backends", timeout=PATIENCE_SECONDS).json()["data"]
    return {item["name"]: item for item in listing}


def test_a_stalled_replica_loses_no_request_and_comes_back_after_an_inference_probe(
    replicas: EmulatedReplicas,
) -> None:
    with GatewayProcess(replicas.urls, "--stall-seconds", "1", "--health-interval", "0.5") as gw:
        stuck = replicas.urls[0]
        name = stuck.removeprefix("http://")
        failures: list[str] = []
        cut: list[str] = []
        answered: list[str] = []
        running = threading.Event()
        running.set()

        def load(worker: int) -> None:
            turn = 0
            while running.is_set():
                turn += 1
                try:
                    response = chat(gw.url, f"w{worker}-{turn}")
                except httpx.HTTPError as error:
                    failures.append(repr(error))
                    continue
                text = response.text
                if response.status_code == 200 and '"code":"upstream_stalled"' in text:
                    cut.append(response.headers["x-gateway-backend"])  # begun there before
                elif response.status_code != 200 or '"error"' in text or "[DONE]" not in text:
                    failures.append(f"{response.status_code} {text[-200:]}")
                else:
                    answered.append(response.headers["x-gateway-backend"])

        clients = [threading.Thread(target=load, args=(worker,)) for worker in range(4)]
        for client in clients:
            client.start()
        try:
            wait_until(lambda: name in answered, f"{name} answering", 60)
            stall(stuck, True)
            wait_until(lambda: bool(backends(gw)[name]["stalled"]), f"{name} seen stalled", 60)
            count = len(answered)
            wait_until(lambda: len(answered) > count + 20, "the others carrying the load", 60)
            stall(stuck, False)
            wait_until(lambda: not backends(gw)[name]["stalled"], f"{name} no longer stalled", 60)
            wait_until(lambda: backends(gw)[name]["healthy"] is True, f"{name} healthy", 60)
        finally:
            running.clear()
            for client in clients:
                client.join(60)
        # Every request completed, but streams already begun on it when it stalled: those end
        # with the documented error event (one per client at most).
        assert failures == []
        assert set(cut) <= {name} and len(cut) <= 4
        text = gw.metrics()
        assert metric_value(text, "gateway_backend_stalls_total", backend=name) == 1
        assert metric_value(text, "gateway_backend_stalled", backend=name) == 0


def test_a_stream_already_begun_on_a_replica_that_stalls_ends_with_an_error_event(
    replicas: EmulatedReplicas,
) -> None:
    with GatewayProcess(replicas.urls, "--stall-seconds", "1") as gw:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "a long answer"}],
            "max_tokens": 2000,
            "stream": True,
        }
        with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=60) as long:
            backend = long.headers["x-gateway-backend"]
            lines = long.iter_lines()
            assert next(lines).startswith("data: ")
            stall(f"http://{backend}", True)
            # Requests left waiting on it show the stall; the stream begun there ends in an error.
            others = [
                threading.Thread(target=chat, args=(gw.url, f"probe {turn}")) for turn in range(6)
            ]
            for other in others:
                other.start()
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest, "the stream ended without a last event"
        last = orjson.loads(rest[-1].removeprefix("data: "))
        assert last["error"]["code"] == "upstream_stalled"
        for other in others:
            other.join(60)
        stall(f"http://{backend}", False)


def test_a_long_prefill_alone_on_its_replica_is_not_a_stall() -> None:
    # 100k tokens at 60 µs each: six seconds of prefill, with nothing else produced meanwhile.
    with (
        EmulatedReplicas(
            1,
            MODEL,
            ["--prefill-us-per-token", "60", "--cache-blocks", "16384"],
        ) as replica,
        GatewayProcess(replica.urls, "--stall-seconds", "1", "--max-body-bytes", "4194304") as gw,
    ):
        for turn in range(5):
            assert chat(gw.url, f"warm {turn}", stream=False).status_code == 200
        words = " ".join(f"w{index % 997}" for index in range(100_000))
        body = {"model": MODEL, "prompt": words, "max_tokens": 2, "stream": True}
        with httpx.stream("POST", gw.url + "/v1/completions", json=body, timeout=120) as long:
            text = long.read().decode()
        assert long.status_code == 200 and "[DONE]" in text and '"error"' not in text
        assert metric_value(gw.metrics(), "gateway_backend_stalls_total") == 0
