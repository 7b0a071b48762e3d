"""Affinity hits and misses, failovers and cache-breaking events, counted by a live gateway."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from prefix_gateway.emulator.replicas import EmulatedReplicas
from tests.conftest import MODEL
from tests.support import GatewayProcess
from tests.words import words

Message = dict[str, Any]


@pytest.fixture(scope="module")
def fleet() -> Iterator[EmulatedReplicas]:
    with EmulatedReplicas(2, MODEL) as started:
        yield started


@pytest.fixture(scope="module")
def gateway(fleet: EmulatedReplicas) -> Iterator[GatewayProcess]:
    # Probes far apart: a replica that dies stays a candidate until a request fails on it.
    with GatewayProcess(fleet.urls, "--health-interval", "60") as started:
        yield started


class Counters:
    """Deltas of the gateway's counters since the object was made."""

    def __init__(self, gateway: GatewayProcess) -> None:
        self._gateway = gateway
        self._start = self._read()

    def _read(self) -> dict[str, float]:
        gateway = self._gateway
        values = {
            "hits": gateway.metric("gateway_affinity_hits_total", model=MODEL),
            "failovers": gateway.metric("gateway_failovers_total", model=MODEL),
        }
        for cause in ("unhealthy", "load_bound", "index", "spread", "failover"):
            values[f"miss:{cause}"] = gateway.metric(
                "gateway_affinity_misses_total", model=MODEL, cause=cause
            )
        for cause in ("front_trim", "system_prompt", "rewritten_answer", "mid_edit"):
            values[f"break:{cause}"] = gateway.metric(
                "gateway_cache_breaks_total", model=MODEL, cause=cause
            )
        return values

    def changed(self) -> dict[str, float]:
        now = self._read()
        return {
            name: now[name] - self._start[name] for name in now if now[name] != self._start[name]
        }


def turn(
    gateway: GatewayProcess, messages: list[Message], session: str | None = None
) -> tuple[str, str]:
    """Send the conversation so far; returns the answer and the backend that wrote it."""
    headers = {"x-session-id": session} if session else {}
    response = httpx.post(
        gateway.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 20},
        headers=headers,
        timeout=10,
    )
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"], response.headers[
        "x-gateway-backend"
    ]


def converse(
    gateway: GatewayProcess, messages: list[Message], turns: int, tag: str
) -> list[Message]:
    for number in range(turns):
        messages.append({"role": "user", "content": words(30, f"{tag}{number}")})
        answer, _ = turn(gateway, messages)
        messages.append({"role": "assistant", "content": answer})
    return messages


def system(tag: str) -> Message:
    return {"role": "system", "content": words(200, tag)}


def test_turns_of_one_conversation_are_affinity_hits(gateway: GatewayProcess) -> None:
    counters = Counters(gateway)
    converse(gateway, [system("ah")], 4, "ahq")
    assert counters.changed() == {"hits": 3}


def test_a_sliding_window_is_a_front_trim(gateway: GatewayProcess) -> None:
    history = converse(gateway, [system("ft")], 3, "ftq")
    counters = Counters(gateway)
    window = [history[0], *history[3:], {"role": "user", "content": words(30, "ftnew")}]
    turn(gateway, window)
    assert counters.changed() == {"break:front_trim": 1}


def test_an_answer_stripped_of_its_reasoning_is_a_rewritten_answer(
    gateway: GatewayProcess,
) -> None:
    messages = [system("rw"), {"role": "user", "content": words(30, "rwq")}]
    answer, _ = turn(gateway, messages)
    counters = Counters(gateway)
    stripped = answer.split(" ", 1)[1]  # what a template dropping `<think>…</think>` does
    messages += [
        {"role": "assistant", "content": stripped},
        {"role": "user", "content": words(30, "rwq2")},
    ]
    turn(gateway, messages)
    assert counters.changed() == {"break:rewritten_answer": 1}


def test_an_edited_earlier_question_is_a_mid_edit(gateway: GatewayProcess) -> None:
    history = converse(gateway, [system("me")], 3, "meq")
    counters = Counters(gateway)
    edited = [*history[:3], {"role": "user", "content": words(30, "meedit")}, *history[4:]]
    turn(gateway, [*edited, {"role": "user", "content": "and now?"}])
    assert counters.changed() == {"break:mid_edit": 1}


def test_a_session_sees_its_system_prompt_change(gateway: GatewayProcess) -> None:
    question = {"role": "user", "content": words(30, "spq")}
    _, first = turn(gateway, [system("sp1"), question], session="metrics-sp")
    counters = Counters(gateway)
    _, second = turn(gateway, [system("sp2"), question], session="metrics-sp")
    assert second == first  # the session keeps its replica
    assert counters.changed() == {"break:system_prompt": 1, "hits": 1}


def test_a_dead_replica_turns_hits_into_failover_and_unhealthy_misses(
    fleet: EmulatedReplicas, gateway: GatewayProcess
) -> None:
    """Runs last: it stops a replica of the module's fleet."""
    started: dict[str, list[list[Message]]] = {}
    for number in range(8):
        messages = [system(f"dr{number}"), {"role": "user", "content": words(30, f"drq{number}")}]
        answer, backend = turn(gateway, messages)
        messages.append({"role": "assistant", "content": answer})
        messages.append({"role": "user", "content": "go on"})
        started.setdefault(backend, []).append(messages)
    victim, conversations = max(started.items(), key=lambda item: len(item[1]))
    assert len(conversations) >= 2
    next(replica for replica in fleet.replicas if replica.url.endswith(victim)).stop()

    counters = Counters(gateway)
    _, backend = turn(gateway, conversations[0])  # fails over before the first byte
    assert backend != victim
    assert counters.changed() == {"miss:failover": 1, "failovers": 1}
    counters = Counters(gateway)
    _, backend = turn(gateway, conversations[1])  # the victim is ejected by now
    assert backend != victim
    assert counters.changed() == {"miss:unhealthy": 1}
