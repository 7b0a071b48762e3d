"""Named tenants from the `tenants:` configuration, end to end: their keys, their budgets per
minute and in flight, OpenAI's 429 and rate-limit headers as the official client sees them,
the per-tenant series and `/admin/tenants`. Real processes throughout: emulated replicas and a
gateway started with a YAML file of its own."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from prefix_gateway.config import ConfigError, load_settings
from prefix_gateway.emulator.replicas import EmulatedReplicas
from tests.fault_servers import FaultServer
from tests.support import GatewayProcess, metric_value, wait_until

MODEL = "emulated-model"
TENANTS: list[dict[str, Any]] = [
    {"name": "batch", "api_key_env": "BATCH_KEY", "requests_per_minute": 3},
    {"name": "chat", "api_key": "chat-key", "priority": 1, "weight": 2},
    {"name": "tight", "api_key": "tight-key", "tokens_per_minute": 600},
    {"name": "single", "api_key": "single-key", "max_concurrency": 1},
]


@pytest.fixture(scope="module")
def replicas() -> Iterator[EmulatedReplicas]:
    # Slow enough decoding that a stream of 200 tokens is still running while others start.
    with EmulatedReplicas(2, MODEL, ["--decode-ms-per-token", "20"]) as started:
        yield started


@pytest.fixture(scope="module")
def gateway(
    replicas: EmulatedReplicas, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    config = tmp_path_factory.mktemp("tenants") / "gateway.yaml"
    config.write_text(yaml.safe_dump({"tenants": TENANTS}))
    args = ("--config", str(config), "--api-key", "plain-key")
    with GatewayProcess(replicas.urls, *args, env={"BATCH_KEY": "batch-key"}) as started:
        yield started


def client(gateway: GatewayProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)


def ask(api: openai.OpenAI, text: str, max_tokens: int = 4) -> Any:
    return api.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=max_tokens
    )


def test_requests_per_minute_refused_with_openais_429_and_headers(
    gateway: GatewayProcess,
) -> None:
    with client(gateway, "batch-key") as batch, client(gateway, "chat-key") as chat:
        remaining = []
        for turn in range(3):
            raw = ask(batch, f"batch job {turn}")
            assert raw.headers["x-ratelimit-limit-requests"] == "3"
            remaining.append(int(raw.headers["x-ratelimit-remaining-requests"]))
            assert raw.headers["x-ratelimit-reset-requests"].endswith("s")
        # Each request takes one; at most one has come back in the meantime (a minute refills 3).
        assert (
            remaining[0] == 2
            and remaining[-1] <= 1
            and remaining == sorted(remaining, reverse=True)
        )
        with pytest.raises(openai.RateLimitError) as refused:
            for turn in range(3, 6):
                ask(batch, f"batch job {turn}")
        error = refused.value
        assert error.code == "rate_limit_exceeded"
        assert "requests per minute" in error.message and "batch" in error.message
        assert int(error.response.headers["retry-after"]) >= 1
        assert int(error.response.headers["retry-after-ms"]) >= 1
        assert error.response.headers["x-ratelimit-limit-requests"] == "3"
        # Another tenant is not throttled by it, and has no budget headers (it has no limits).
        served = ask(chat, "a quick question")
        assert served.parse().choices[0].message.content
        assert "x-ratelimit-limit-requests" not in served.headers
    text = gateway.metrics()
    assert metric_value(text, "gateway_tenant_refusals_total", tenant="batch") >= 1
    assert (
        metric_value(
            text, "gateway_tenant_refusals_total", tenant="batch", reason="requests_per_minute"
        )
        >= 1
    )
    assert metric_value(text, "gateway_tenant_requests_total", tenant="batch", status="200") == 3
    assert metric_value(text, "gateway_tenant_requests_total", tenant="chat", status="200") >= 1
    assert metric_value(text, "gateway_tenant_refusals_total", tenant="chat") == 0


def test_tokens_are_charged_ahead_and_settled_with_the_engines_usage(
    gateway: GatewayProcess,
) -> None:
    with client(gateway, "tight-key") as tight:
        # More than the whole minute's tokens can ever pay for: refused, with no Retry-After.
        with pytest.raises(openai.RateLimitError) as too_large:
            ask(tight, "a long answer please", max_tokens=5000)
        assert "request too large" in too_large.value.message
        assert "retry-after" not in too_large.value.response.headers
        raw = ask(tight, "a short answer", max_tokens=8)
        reply = raw.parse()
        assert int(raw.headers["x-ratelimit-limit-tokens"]) == 600
        # The estimate (prompt + max_tokens) was charged when the answer began.
        assert int(raw.headers["x-ratelimit-remaining-tokens"]) < 600
    views = {view["name"]: view for view in admin_tenants(gateway)}
    used = views["tight"]["tokens"]
    assert used["prompt"] == reply.usage.prompt_tokens
    assert used["completion"] == reply.usage.completion_tokens
    assert views["tight"]["refusals"] == {"tokens_per_minute": 1}
    assert views["tight"]["in_flight"] == 0
    text = gateway.metrics()
    counted = metric_value(text, "gateway_tenant_tokens_total", tenant="tight", kind="prompt")
    assert counted == reply.usage.prompt_tokens


def test_max_concurrency_refuses_a_second_request_while_the_first_is_in_flight(
    gateway: GatewayProcess,
) -> None:
    first_chunk = threading.Event()
    finished = threading.Event()

    def long_stream() -> None:
        with client(gateway, "single-key") as single:
            stream = single.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "tell a long story"}],
                max_tokens=200,
                stream=True,
            )
            for _ in stream:
                first_chunk.set()
        finished.set()

    streaming = threading.Thread(target=long_stream)
    streaming.start()
    try:
        assert first_chunk.wait(60)
        with client(gateway, "single-key") as single, pytest.raises(openai.RateLimitError) as busy:
            ask(single, "and meanwhile?")
        assert "in flight" in busy.value.message
    finally:
        streaming.join(120)
    assert finished.is_set()
    with client(gateway, "single-key") as single:
        assert ask(single, "now?").parse().choices
    views = {view["name"]: view for view in admin_tenants(gateway)}
    assert views["single"]["refusals"] == {"max_concurrency": 1}
    assert views["single"]["requests"]["200"] == 2


def test_keys_given_with_api_key_are_anonymous_and_unlimited(gateway: GatewayProcess) -> None:
    before = metric_value(
        gateway.metrics(), "gateway_tenant_requests_total", tenant="anonymous", status="200"
    )
    with client(gateway, "plain-key") as plain:
        for turn in range(5):
            raw = ask(plain, f"anonymous {turn}")
            assert "x-ratelimit-limit-requests" not in raw.headers
    with client(gateway, "no-such-key") as stranger, pytest.raises(openai.AuthenticationError):
        ask(stranger, "let me in")
    after = metric_value(
        gateway.metrics(), "gateway_tenant_requests_total", tenant="anonymous", status="200"
    )
    assert after - before == 5
    names = {view["name"] for view in admin_tenants(gateway)}
    assert names == {"batch", "chat", "tight", "single"}
    text = gateway.metrics()
    assert "batch-key" not in text and "chat-key" not in text  # keys are never shown


def admin_tenants(gateway: GatewayProcess) -> list[dict[str, Any]]:
    answer = httpx.get(gateway.url + "/admin/tenants", timeout=10)
    assert answer.status_code == 200
    data: list[dict[str, Any]] = answer.json()["data"]
    return data


def test_a_gateway_without_tenants_lists_none_and_counts_no_tenant_series(
    replicas: EmulatedReplicas,
) -> None:
    with GatewayProcess(replicas.urls) as plain:
        assert admin_tenants(plain) == []
        with client(plain, "unused") as api:
            ask(api, "hello")
        wait_until(lambda: "gateway_requests_total{" in plain.metrics(), "a request counted")
        assert "gateway_tenant_requests_total{" not in plain.metrics()


@pytest.mark.parametrize(
    ("entry", "complaint"),
    [
        ({"api_key": "k"}, r"tenants\[0\]: name must be"),
        ({"name": "a b", "api_key": "k"}, r"tenants\[0\]: name must be"),
        ({"name": "anonymous", "api_key": "k"}, r"not 'anonymous'"),
        ({"name": "x"}, r"tenants\[0\] \(x\): give exactly one of api_key and api_key_env"),
        ({"name": "x", "api_key": "k", "api_key_env": "K"}, r"\(x\): give exactly one"),
        ({"name": "x", "api_key_env": "UNSET_KEY"}, r"\(x\): the environment variable UNSET_KEY"),
        ({"name": "x", "api_key": "k", "weight": 0}, r"\(x\): weight must be a positive number"),
        ({"name": "x", "api_key": "k", "requests_per_minute": -1}, r"\(x\): requests_per_minute"),
        ({"name": "x", "api_key": "k", "priority": "high"}, r"\(x\): priority must be an integer"),
        ({"name": "x", "api_key": "k", "budget": 5}, r"\(x\): unknown fields \['budget'\]"),
    ],
)
def test_a_bad_tenant_is_a_start_up_error_that_names_it(
    tmp_path: Path, entry: dict[str, Any], complaint: str
) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({"backend": ["http://a:1"], "tenants": [entry]}))
    with pytest.raises(ConfigError, match=complaint):
        load_settings(environ={"GATEWAY_CONFIG": str(config)})


def test_tenants_read_from_the_file_with_their_keys_from_the_environment(tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    entries = [
        {"name": "a", "api_key_env": "A_KEY", "tokens_per_minute": 1000},
        {"name": "b", "api_key": "kb"},
    ]
    config.write_text(yaml.safe_dump({"backend": ["http://a:1"], "tenants": entries}))
    settings = load_settings(environ={"GATEWAY_CONFIG": str(config), "A_KEY": "ka"})
    assert [(t.name, t.api_key, t.tokens_per_minute) for t in settings.tenants] == [
        ("a", "ka", 1000),
        ("b", "kb", 0),
    ]
    assert "ka" not in repr(settings)  # keys are kept out of what could be logged
    twice = [{"name": "a", "api_key": "k"}, {"name": "b", "api_key": "k"}]
    config.write_text(yaml.safe_dump({"backend": ["http://a:1"], "tenants": twice}))
    with pytest.raises(ConfigError, match=r"tenants\[1\] \(b\): its key is another tenant's"):
        load_settings(environ={"GATEWAY_CONFIG": str(config)})


def test_isolate_tenants_gives_named_tenants_their_own_cache_salt(tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    named = [{"name": "one", "api_key": "one-key"}, {"name": "two", "api_key": "two-key"}]
    config.write_text(yaml.safe_dump({"tenants": named}))
    args = ("--config", str(config), "--api-key", "plain-key", "--isolate-tenants")
    with FaultServer() as replica, GatewayProcess([f"{MODEL}={replica.url}"], *args) as gateway:
        for key in ("one-key", "two-key", "one-key", "plain-key"):
            with client(gateway, key) as api:
                ask(api, "the same prompt for everyone")
        salts = [json.loads(request.body)["cache_salt"] for request in replica.seen]
    # Each key its own namespace, the same one every time; no key's salt is the key itself.
    assert salts[0] == salts[2]
    assert len(set(salts)) == 3
    assert not {"one-key", "two-key", "plain-key"} & set(salts)
