"""End to end: a replica that evicted a prefix says so in its cached tokens, and the gateway
forgets what the replica no longer holds.

Two emulated replicas with a small prefix cache (100 blocks of 16 tokens), the gateway on a
real port, the official `openai` client; the eviction is real: prompts sent to the replica
directly, behind the gateway's back, fill its cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from prefix_gateway.emulator.replicas import EmulatedReplicas
from tests.conftest import MODEL
from tests.support import GatewayProcess, wait_until
from tests.test_explain import AUTH, TOKEN
from tests.words import words

Message = dict[str, Any]


@pytest.fixture(scope="module")
def fleet() -> Iterator[EmulatedReplicas]:
    args = ["--chat-template", "plain", "--cache-blocks", "100"]
    with EmulatedReplicas(2, MODEL, args) as started:
        yield started


def admitted(gateway: GatewayProcess, replicas: int = 2) -> GatewayProcess:
    """Every replica admitted: a first probe slowed by a busy machine may have failed."""
    wait_until(
        lambda: httpx.get(gateway.url + "/health", timeout=5).json()["healthy"] >= replicas,
        f"{replicas} replicas healthy",
    )
    return gateway


@pytest.fixture(scope="module")
def gateway(fleet: EmulatedReplicas) -> Iterator[GatewayProcess]:
    with GatewayProcess(fleet.urls, "--admin-token", TOKEN) as started:
        yield admitted(started)


@pytest.fixture(scope="module")
def blind(fleet: EmulatedReplicas) -> Iterator[GatewayProcess]:
    """The same, without cache feedback."""
    with GatewayProcess(fleet.urls, "--admin-token", TOKEN, "--no-cache-feedback") as started:
        yield admitted(started)


def client_of(gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def client(gateway: GatewayProcess) -> Iterator[openai.OpenAI]:
    with client_of(gateway) as api:
        yield api


def ask(client: openai.OpenAI, messages: list[Message]) -> tuple[str, str, int]:
    """Send `messages`; the backend that answered, its route and the cached tokens reported."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
    )
    reply = raw.parse()
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    cached = reply.usage.prompt_tokens_details.cached_tokens or 0
    return raw.headers["x-gateway-backend"], raw.headers["x-gateway-route"], cached


def matched_tokens(gateway: GatewayProcess, messages: list[Message]) -> dict[str, int]:
    """What the index predicts for `messages` on each replica (`/admin/explain`)."""
    response = httpx.post(
        gateway.url + "/admin/explain",
        json={"model": MODEL, "messages": messages},
        headers=AUTH,
        timeout=5,
    )
    assert response.status_code == 200, response.text
    return {item["backend"]: item["matched_tokens"] for item in response.json()["candidates"]}


class Feedback:
    """The feedback counters of one backend, and waiting for them: the gateway learns from a
    response only after the client has it."""

    def __init__(self, gateway: GatewayProcess, backend: str) -> None:
        self._gateway = gateway
        self._backend = backend
        self.start = self.read()

    def read(self) -> dict[str, float]:
        metric = self._gateway.metric
        values = {
            outcome: metric(
                "gateway_index_feedback_total", model=MODEL, backend=self._backend, outcome=outcome
            )
            for outcome in ("confirmed", "shallower", "deeper")
        }
        values["pruned"] = metric(
            "gateway_index_feedback_pruned_blocks_total", model=MODEL, backend=self._backend
        )
        return values

    def grown(self) -> dict[str, float]:
        now = self.read()
        return {name: now[name] - self.start[name] for name in now if now[name] != self.start[name]}

    def wait(self, done: Callable[[dict[str, float]], bool]) -> dict[str, float]:
        wait_until(lambda: done(self.grown()), "the feedback counters to grow")
        return self.grown()


def evict(backend: str, tag: str) -> None:
    """Behind the gateway's back, other prompts fill the replica's 100 blocks three times over
    its least recently used ones: what it cached before is gone."""
    for filler in range(3):
        response = httpx.post(
            f"http://{backend}/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": words(1000, f"{tag}{filler}")}],
                "max_tokens": 1,
            },
            timeout=10,
        )
        assert response.status_code == 200, response.text


def question(system: Message, tag: str) -> list[Message]:
    return [system, {"role": "user", "content": words(40, tag)}]


def test_a_report_that_meets_the_prediction_confirms_it(
    gateway: GatewayProcess, client: openai.OpenAI
) -> None:
    system = {"role": "system", "content": words(400, "pc")}
    backend, _, cached = ask(client, question(system, "pcq0"))
    assert cached == 0
    feedback = Feedback(gateway, backend)
    predicted = matched_tokens(gateway, question(system, "pcq1"))[backend]
    assert predicted > 0
    second, route, cached = ask(client, question(system, "pcq1"))
    # Kept by its holder: as its owner while the prompt is cold among the module's requests,
    # or as the only holder of a hot one.
    assert second == backend and route in ("owner", "prefix")
    assert cached == 400  # the whole system prompt: 25 blocks of 16 tokens
    assert feedback.wait(lambda grown: "confirmed" in grown) == {"confirmed": 1}


def test_an_evicted_prefix_is_pruned_from_the_index(
    fleet: EmulatedReplicas, gateway: GatewayProcess, client: openai.OpenAI
) -> None:
    system = {"role": "system", "content": words(400, "pe")}
    backend, _, _ = ask(client, question(system, "peq0"))
    again, _, cached = ask(client, question(system, "peq1"))
    assert again == backend and cached == 400
    feedback = Feedback(gateway, backend)
    before = matched_tokens(gateway, question(system, "peq0"))
    assert before[backend] > matched_tokens(gateway, question(system, "pe-new"))[backend]

    evict(backend, "pf")
    predicted = matched_tokens(gateway, question(system, "peq2"))[backend]
    assert predicted >= 256  # the index still attributes the system prompt to the replica

    third, route, cached = ask(client, question(system, "peq2"))
    assert third == backend and route in ("owner", "prefix")
    assert cached == 0  # the replica computed it all again
    grown = feedback.wait(lambda grown: "shallower" in grown and "pruned" in grown)
    assert grown.get("shallower") == 1 and "confirmed" not in grown
    assert grown["pruned"] >= 2  # the two earlier questions' own blocks, at least

    # The earlier question is now predicted only as deep as the prefix the third one
    # recomputed (the system prompt), no longer down to its own blocks.
    after = matched_tokens(gateway, question(system, "peq0"))
    shared = matched_tokens(gateway, question(system, "pe-new"))[backend]
    assert after[backend] == shared < before[backend]
    assert shared >= predicted - 16  # what the third request put back stays predicted
    assert set(after) == set(before) == {url.removeprefix("http://") for url in fleet.urls}


def test_without_feedback_the_index_keeps_predicting_what_was_evicted(
    blind: GatewayProcess,
) -> None:
    client = client_of(blind)
    system = {"role": "system", "content": words(400, "pb")}
    backend, _, _ = ask(client, question(system, "pbq0"))
    assert ask(client, question(system, "pbq1"))[0] == backend
    before = matched_tokens(blind, question(system, "pbq0"))[backend]
    evict(backend, "pbf")
    answered = blind.metric("gateway_requests_total", model=MODEL)
    third, _, cached = ask(client, question(system, "pbq2"))
    assert third == backend and cached == 0
    # Counted as answered in the same step that, right after, would give the feedback the
    # answer's cached tokens, with no wait between them.
    wait_until(
        lambda: blind.metric("gateway_requests_total", model=MODEL) > answered,
        "the third question counted as answered",
    )
    assert matched_tokens(blind, question(system, "pbq0"))[backend] == before
    assert blind.metric("gateway_index_feedback_total") == 0
