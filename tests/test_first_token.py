"""The learned time to first token: each replica's line, the faster route it drives, and both
through a live gateway in front of emulated replicas, one of which slows down and recovers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from prefix_gateway.clock import ManualClock
from prefix_gateway.config import Settings
from prefix_gateway.emulator.replicas import EmulatedReplicas
from prefix_gateway.routing.first_token import FirstTokenModel
from prefix_gateway.routing.prefix_policy import PrefixPolicy
from prefix_gateway.routing.types import Route, RoutingState
from tests.support import PATIENCE_SECONDS, GatewayProcess, metric_value, wait_until
from tests.words import words

FAST, SLOW = "fast:1", "slow:1"


def taught(clock: ManualClock, slow_factor: float = 3.0, rounds: int = 20) -> FirstTokenModel:
    """A model that has seen both replicas answer at 1 ms a token of work plus 5 ms, the slow
    one `slow_factor` times slower."""
    model = FirstTokenModel(half_life=3.0, clock=clock)
    for step in range(rounds):
        work = 100 + 50 * (step % 7)
        model.observe(FAST, work, 0.005 + 0.001 * work)
        model.observe(SLOW, work, 0.005 + 0.001 * slow_factor * work)
        clock.advance(0.05)
    return model


def test_nothing_is_predicted_before_the_fleet_has_answered() -> None:
    model = FirstTokenModel(half_life=3.0, clock=ManualClock())
    assert model.seconds(FAST, 1000) is None
    model.observe(FAST, 100, 0.1)
    assert not model.learned and model.seconds(FAST, 1000) is None


def test_each_replica_gets_its_own_line() -> None:
    model = taught(ManualClock())
    fast, slow = model.line(FAST), model.line(SLOW)
    assert fast is not None and slow is not None
    # Each leans a little on the fleet's line (slope 0.002) until it has more of its own.
    assert fast.slope == pytest.approx(0.001, rel=0.2)
    assert slow.slope == pytest.approx(0.003, rel=0.2)
    assert slow.slope > 2.2 * fast.slope
    # A replica never observed predicts the fleet's line: nothing says it is slow or fast.
    newcomer = model.seconds("new:1", 500)
    assert newcomer is not None
    assert model.seconds(FAST, 500) < newcomer < model.seconds(SLOW, 500)  # type: ignore[operator]


def test_only_a_replica_clearly_slower_than_the_fleet_counts_as_slow() -> None:
    assert taught(ManualClock(), slow_factor=1.2).slowness() == {}
    slowness = taught(ManualClock(), slow_factor=3.0).slowness()
    assert set(slowness) == {SLOW}
    # Against the typical replica's line (each leans a little on the fleet's).
    assert 2.0 <= slowness[SLOW] <= 3.2


def test_a_slowdown_and_a_recovery_are_followed_within_a_few_half_lives() -> None:
    clock = ManualClock()
    model = taught(clock, slow_factor=1.0)
    even = model.seconds(SLOW, 500)
    assert even == pytest.approx(model.seconds(FAST, 500), rel=0.05)
    # It turns three times slower: a few seconds of its answers say so.
    for step in range(40):
        work = 100 + 50 * (step % 7)
        model.observe(SLOW, work, 0.005 + 0.003 * work)
        model.observe(FAST, work, 0.005 + 0.001 * work)
        clock.advance(0.2)
    slowed = model.seconds(SLOW, 500)
    assert slowed is not None and even is not None and slowed > 2.5 * even
    # It recovers: as many seconds (2.7 half-lives) bring it most of the way back.
    for step in range(40):
        work = 100 + 50 * (step % 7)
        model.observe(SLOW, work, 0.005 + 0.001 * work)
        model.observe(FAST, work, 0.005 + 0.001 * work)
        clock.advance(0.2)
    recovered = model.seconds(SLOW, 500)
    assert recovered is not None and recovered - even < 0.2 * (slowed - even)


def test_a_replica_no_longer_observed_drifts_back_to_the_fleets_line() -> None:
    clock = ManualClock()
    model = taught(clock)
    before = model.seconds(SLOW, 500)
    for step in range(100):  # 20 s in which only the fast replica answers
        work = 100 + 50 * (step % 7)
        model.observe(FAST, work, 0.005 + 0.001 * work)
        clock.advance(0.2)
    slow, fleet = model.seconds(SLOW, 500), model.seconds("new:1", 500)
    assert slow is not None and fleet is not None and before is not None
    assert slow - fleet < 0.2 * (before - fleet)  # most of the way back


def test_a_fast_replica_no_longer_observed_is_not_forgotten_into_a_slow_fleets_line() -> None:
    # Another gateway's placements, or the rule's, may leave this gateway sending only to the
    # slow replica: its fleet line becomes the slow one's. The fast replica, unobserved, must
    # still look fast, or it is never tried again.
    clock = ManualClock()
    model = taught(clock)
    for step in range(100):  # 20 s in which only the slow replica answers
        work = 100 + 50 * (step % 7)
        model.observe(SLOW, work, 0.005 + 0.003 * work)
        clock.advance(0.2)
    fast, slow = model.seconds(FAST, 500), model.seconds(SLOW, 500)
    assert fast is not None and slow is not None
    assert slow > 2.0 * fast
    assert model.slowness().keys() == {SLOW}


def _state(model: FirstTokenModel, **given: Any) -> RoutingState:
    base: dict[str, Any] = {
        "candidates": (FAST, SLOW),
        "loads": {FAST: 0, SLOW: 0},
        "hashes": list(range(100)),  # 100 blocks of 16 tokens
        "affinity_key": 7,
        "prompt_tokens": 1600,
        "first_token": model,
    }
    return RoutingState(**(base | given))


POLICY = PrefixPolicy(Settings())


def test_a_new_prompt_goes_to_the_replica_that_answers_sooner() -> None:
    model = taught(ManualClock())
    # Wherever the rules put it, a new prompt ends on the fast replica, its time predicted.
    for key in range(20):
        decision = POLICY.choose(_state(model, affinity_key=key))
        assert decision.backend == FAST
        assert decision.route in (Route.HASH, Route.FASTER)
        assert decision.predicted_seconds == pytest.approx(0.005 + 0.001 * 1600, rel=0.2)


def test_a_hit_on_the_slow_replica_is_worth_its_prefill() -> None:
    model = taught(ManualClock())
    # The slow replica holds 90 of the 100 blocks: 160 tokens to compute there (0.49 s at
    # 3 ms) against 1,600 on the fast one (1.6 s). The hit keeps it.
    decision = POLICY.choose(_state(model, matched={SLOW: 90}))
    assert (decision.backend, decision.route) == (SLOW, Route.OWNER)
    # With 2,000 tokens of prefill queued ahead of it there, the fast replica is sooner.
    queued = _state(model, matched={SLOW: 90}, pending_prefill={SLOW: 125})
    decision = POLICY.choose(queued)
    assert (decision.backend, decision.route) == (FAST, Route.FASTER)
    assert decision.ahead_tokens == 0


def test_the_load_bound_still_holds() -> None:
    model = taught(ManualClock())
    # The fast replica is at the bound (floor 2): the request stays on the slow one.
    full = _state(model, loads={FAST: 2, SLOW: 0}, total_load=2)
    decision = POLICY.choose(full)
    assert decision.backend == SLOW and decision.route is not Route.FASTER
    assert decision.predicted_seconds is not None


MODEL = "emulated-model"
PREFILL_US = 500.0  # 0.5 ms a token: a 1,200-token prompt takes 0.6 s, 1.8 s three times slower


@pytest.fixture(scope="module")
def fleet() -> Iterator[EmulatedReplicas]:
    args = ["--prefill-us-per-token", str(PREFILL_US), "--cache-blocks", "4096"]
    with EmulatedReplicas(2, MODEL, args) as replicas:
        yield replicas


@pytest.fixture(scope="module")
def gateway(fleet: EmulatedReplicas) -> Iterator[GatewayProcess]:
    args = ("--admin-token", "t", "--ttft-routing", "--ttft-half-life", "6")
    with GatewayProcess(fleet.urls, *args) as started:
        yield started


def _stream(client: openai.OpenAI, seed: int) -> str:
    """A new 1,200-token prompt, streamed; the replica that answered it."""
    stream = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": words(1200, f"q{seed:04d}")}],
        max_tokens=2,
        stream=True,
    )
    backend = stream.headers["x-gateway-backend"]
    for _ in stream.parse():
        pass
    return backend


def _slow_down(replica_url: str, factor: float) -> None:
    response = httpx.post(
        replica_url + "/emulator/slowdown", json={"factor": factor}, timeout=PATIENCE_SECONDS
    )
    assert response.status_code == 200 and response.json() == {"factor": factor}


def test_the_emulator_refuses_a_slowdown_that_is_not_a_positive_number(
    fleet: EmulatedReplicas,
) -> None:
    for bad in (0, -1, "3", True, None):
        response = httpx.post(
            fleet.urls[0] + "/emulator/slowdown", json={"factor": bad}, timeout=PATIENCE_SECONDS
        )
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "factor"


def test_a_replica_that_slows_down_loses_its_share_and_regains_it(
    fleet: EmulatedReplicas, gateway: GatewayProcess
) -> None:
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    slow_url = fleet.urls[0]
    slow = next(str(b["name"]) for b in _backends(gateway) if b["url"] == slow_url)
    seed = iter(range(10_000))
    # Even: both replicas answer, and every stream is predicted once the fleet has answered.
    wait_until(
        lambda: {_stream(client, next(seed)) for _ in range(4)} == {slow, _other(gateway, slow)},
        "both replicas to take new prompts",
    )
    _slow_down(slow_url, 3.0)
    try:
        # Slowed: its streams teach the gateway so, and new prompts stop going there.
        # (A replica unobserved for a while is tried again, so a few still go there.)
        wait_until(
            lambda: [_stream(client, next(seed)) for _ in range(9)].count(slow) <= 2,
            "most new prompts to leave the slowed replica",
            seconds=90,
        )

        # Explain shows why: the slowed replica's prediction, and the choice it leads to.
        def explained_elsewhere() -> bool:
            _stream(client, next(seed))
            explained = _explain(gateway, words(1200, "explained"))
            predicted = {c["backend"]: c["predicted_ttft_ms"] for c in explained["candidates"]}
            assert explained["predicted_ttft_ms"] is not None
            return bool(
                predicted[slow] > 1.5 * predicted[_other(gateway, slow)]
                and explained["backend"] != slow
            )

        wait_until(explained_elsewhere, "explain to predict the slowed replica slower")
    finally:
        _slow_down(slow_url, 1.0)
    # Recovered: once its line is no longer trusted to be slow, it takes new prompts again.
    wait_until(
        lambda: [_stream(client, next(seed)) for _ in range(8)].count(slow) >= 3,
        "the recovered replica to take its share of new prompts again",
        seconds=90,
    )
    metrics = gateway.metrics_text()
    assert metric_value(metrics, "gateway_ttft_predictions_total", backend=slow) > 0
    observed = metric_value(metrics, "gateway_ttft_observed_seconds_total", backend=slow)
    assert observed > 0
    assert metric_value(metrics, "gateway_requests_total", route="faster") > 0


def _backends(gateway: GatewayProcess) -> list[dict[str, Any]]:
    response = httpx.get(
        gateway.url + "/admin/backends",
        headers={"authorization": "Bearer t"},
        timeout=PATIENCE_SECONDS,
    )
    assert response.status_code == 200, response.text
    backends: list[dict[str, Any]] = response.json()["data"]
    return backends


def _other(gateway: GatewayProcess, name: str) -> str:
    return next(str(b["name"]) for b in _backends(gateway) if b["name"] != name)


def _explain(gateway: GatewayProcess, prompt: str) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "stream": True}
    response = httpx.post(
        gateway.url + "/admin/explain",
        json=body,
        headers={"authorization": "Bearer t"},
        timeout=PATIENCE_SECONDS,
    )
    assert response.status_code == 200, response.text
    explained: dict[str, Any] = response.json()
    return explained
