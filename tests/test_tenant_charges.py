"""What a tenant's request reserves and what it is charged (docs/tenants.md, "What a request is
charged"), one rule at a time, through a gateway in front of an emulated replica whose context
is 1,024 tokens (64 blocks of 16) and whose tokens the test can hold.

A reservation is read from the 429 that refuses it (its message says what was requested) or,
while a request is held, from `/admin/tenants`; a charge from the tenant's token counters.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from prefix_gateway.emulator.replicas import EmulatedReplicas
from tests.support import GatewayProcess, stall, wait_until

MODEL = "charged-model"
CONTEXT = 1024
TENANTS = [
    {"name": "small", "api_key": "small-key", "tokens_per_minute": 3000},
    {"name": "tight", "api_key": "tight-key", "tokens_per_minute": 600},
]


@pytest.fixture(scope="module")
def replica() -> Iterator[EmulatedReplicas]:
    args = ["--cache-blocks", str(CONTEXT // 16), "--block-size", "16"]
    with EmulatedReplicas(1, MODEL, [*args, "--decode-ms-per-token", "5"]) as started:
        yield started


def gateway_for(stack: ExitStack, folder: Path, backend: str, *args: str) -> GatewayProcess:
    config = folder / "gateway.yaml"
    config.write_text(yaml.safe_dump({"tenants": TENANTS}))
    return stack.enter_context(
        GatewayProcess([backend], "--config", str(config), "--stall-seconds", "3600", *args)
    )


@pytest.fixture(scope="module")
def gateway(
    replica: EmulatedReplicas, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    with ExitStack() as stack:
        # Listed by its /v1/models, which says its context length.
        yield gateway_for(stack, tmp_path_factory.mktemp("charges"), replica.urls[0])


def post(gateway: GatewayProcess, key: str, **fields: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "count to three"}], **fields}
    return httpx.post(
        gateway.url + "/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {key}"},
        timeout=60,
    )


def requested(refusal: httpx.Response) -> int:
    """The tokens a refused request reserved, as its 429 says."""
    assert refusal.status_code == 429, refusal.text
    message: str = refusal.json()["error"]["message"]
    return int(message.split("requested ")[1].split(";")[0])


def tenant(gateway: GatewayProcess, name: str) -> dict[str, Any]:
    listed = httpx.get(gateway.url + "/admin/tenants", timeout=10).json()["data"]
    found: dict[str, Any] = next(row for row in listed if row["name"] == name)
    return found


@pytest.mark.parametrize("limit", [4000, "4000", 4000.0, "4000.0"])
def test_a_limit_is_read_as_the_engine_reads_it(gateway: GatewayProcess, limit: object) -> None:
    assert 4000 < requested(post(gateway, "small-key", max_tokens=limit)) < 4100


def test_the_larger_of_max_tokens_and_max_completion_tokens_is_reserved(
    gateway: GatewayProcess,
) -> None:
    refusal = post(gateway, "small-key", max_tokens=1, max_completion_tokens=4000)
    assert 4000 < requested(refusal) < 4100


@pytest.mark.parametrize("field", ["n", "best_of"])
def test_each_answer_of_n_is_reserved(gateway: GatewayProcess, field: str) -> None:
    assert 4000 < requested(post(gateway, "small-key", max_tokens=1000, **{field: 4})) < 4100


def test_without_a_limit_the_context_left_after_the_prompt_is_reserved(
    gateway: GatewayProcess,
) -> None:
    # vLLM's own default: the answer may fill the model's context.
    assert requested(post(gateway, "tight-key")) == CONTEXT


def test_without_a_context_length_the_configured_default_is_reserved(
    replica: EmulatedReplicas, tmp_path: Path
) -> None:
    with ExitStack() as stack:
        # Pinned to its model, the replica is not asked for its model list: no context known.
        pinned = f"{MODEL}={replica.urls[0]}"
        gateway = gateway_for(stack, tmp_path, pinned, "--budget-max-tokens", "700")
        assert 700 < requested(post(gateway, "tight-key")) < 720


def test_a_burst_cannot_overdraw_what_its_reservations_hold(
    gateway: GatewayProcess, replica: EmulatedReplicas
) -> None:
    """Reservations count against the budget until they settle: while one request reserving
    about 510 tokens is held, a second does not fit a limit of 600 (with `max_tokens: 1` read
    first, both would)."""
    stall(replica.replicas[0], True)
    held: list[httpx.Response] = []
    limits = {"max_tokens": 1, "max_completion_tokens": 500}
    first = threading.Thread(target=lambda: held.append(post(gateway, "tight-key", **limits)))
    try:
        first.start()
        wait_until(lambda: tenant(gateway, "tight")["reserved_tokens"] > 500, "one reserved")
        second = post(gateway, "tight-key", **limits)
        assert second.status_code == 429
        assert "tokens per minute" in second.json()["error"]["message"]
    finally:
        stall(replica.replicas[0], False)
        first.join(60)
    assert held[0].status_code == 200
    wait_until(lambda: tenant(gateway, "tight")["reserved_tokens"] == 0, "settled")


def test_a_stream_that_did_not_ask_for_usage_is_charged_its_usage(
    gateway: GatewayProcess,
) -> None:
    before = tenant(gateway, "small")["tokens"]
    with httpx.stream(
        "POST",
        gateway.url + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "stream me"}],
            "max_tokens": 9,
            "stream": True,
        },
        headers={"authorization": "Bearer small-key"},
        timeout=60,
    ) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert not any('"usage"' in event and '"choices":[]' in event for event in events)
    wait_until(lambda: tenant(gateway, "small")["tokens"] != before, "charged")
    after = tenant(gateway, "small")["tokens"]
    assert after["completion"] - before["completion"] == 9
    assert after["prompt"] - before["prompt"] > 0


def test_a_request_the_engine_refuses_is_charged_nothing(gateway: GatewayProcess) -> None:
    before = tenant(gateway, "small")["tokens"]
    # Past the replica's context: its 400 is relayed, nothing was generated.
    answer = post(gateway, "small-key", max_tokens=CONTEXT)
    assert answer.status_code == 400
    wait_until(lambda: tenant(gateway, "small")["reserved_tokens"] == 0, "settled")
    assert tenant(gateway, "small")["tokens"] == before


def test_cached_prompt_tokens_count_at_the_cost_given_on_the_command_line(
    replica: EmulatedReplicas, tmp_path: Path
) -> None:
    """With `--cached-token-cost 1` a prompt served from the engine's cache is charged as one
    computed anew (the default, 0.1, would charge its cached tokens a tenth)."""
    prompt = " ".join(f"again{number}" for number in range(300))  # about 600 tokens
    with ExitStack() as stack:
        gateway = gateway_for(stack, tmp_path, replica.urls[0], "--cached-token-cost", "1")
        began = time.monotonic()
        for _ in range(2):
            answer = post(
                gateway,
                "small-key",
                messages=[{"role": "user", "content": prompt}],
                max_tokens=1,
            )
            assert answer.status_code == 200, answer.text
        wait_until(lambda: tenant(gateway, "small")["reserved_tokens"] == 0, "settled")
        view = tenant(gateway, "small")
        refilled = (time.monotonic() - began) * 3000 / 60
    used = view["tokens"]
    assert used["cached"] > 300  # the repeat was served from the engine's cache
    charged = used["prompt"] + used["completion"]  # cached tokens at 1: full tokens
    remaining = view["budgets"]["tokens"]["remaining"]
    assert 3000 - charged - 1 <= remaining <= 3000 - charged + refilled + 1
