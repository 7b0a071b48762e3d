"""`--forward-priority`: every request that runs the model reaches its replica with its tenant's
priority in vLLM's terms (lower is served first: a tenant's priority p is sent as -p, an
anonymous request as 0), whatever the client asked for in its body or in vLLM's
`X-Vllm-Priority` header; without the flag the body goes byte for byte. Real processes: a
gateway started with a tenants YAML, in front of a replica that records what it is sent
(tests.fault_servers) or of emulated replicas."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from prefix_gateway.config import ConfigError, load_settings
from prefix_gateway.emulator.replicas import EmulatedReplicas
from tests.fault_servers import FaultServer, Request
from tests.support import GatewayProcess

MODEL = "emulated-model"
TENANTS: list[dict[str, Any]] = [
    {"name": "interactive", "api_key": "interactive-key", "priority": 2},
    {"name": "batch", "api_key": "batch-key", "priority": -1},
    {"name": "standard", "api_key": "standard-key"},
]
ANONYMOUS_KEY = "anonymous-key"
# Each key and the priority vLLM is to see for it.
SENT_AS = {"interactive-key": -2, "batch-key": 1, "standard-key": 0, ANONYMOUS_KEY: 0}
CHAT: dict[str, Any] = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "which priority do I get?"}],
    "max_tokens": 4,
}
_HI = b'"messages": [{"role": "user", "content": "hi"}]'


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("priority") / "gateway.yaml"
    path.write_text(yaml.safe_dump({"tenants": TENANTS}))
    return path


def gateway_args(config: Path, *flags: str) -> tuple[str, ...]:
    return ("--config", str(config), "--api-key", ANONYMOUS_KEY, *flags)


@pytest.fixture(scope="module")
def replica() -> Iterator[FaultServer]:
    with FaultServer() as started:
        yield started


@pytest.fixture(scope="module")
def gateway(replica: FaultServer, config: Path) -> Iterator[GatewayProcess]:
    args = gateway_args(config, "--forward-priority")
    with GatewayProcess([f"{MODEL}={replica.url}"], *args) as started:
        yield started


def post(
    gateway: GatewayProcess,
    replica: FaultServer,
    key: str,
    body: bytes,
    path: str = "/v1/chat/completions",
    headers: dict[str, str] | None = None,
) -> Request:
    """Send `body` as tenant `key`; the request as the replica got it."""
    request_id = f"req-{len(replica.seen)}-{key}"
    sent = {
        "authorization": f"Bearer {key}",
        "content-type": "application/json",
        "x-request-id": request_id,
        **(headers or {}),
    }
    answer = httpx.post(gateway.url + path, content=body, headers=sent, timeout=30)
    assert answer.status_code == 200, answer.text
    got = [request for request in replica.seen if request.headers["x-request-id"] == request_id]
    assert len(got) == 1, [request.path for request in replica.seen]
    return got[0]


def test_each_tenant_reaches_the_engine_with_its_priority_negated(
    gateway: GatewayProcess, replica: FaultServer
) -> None:
    for key, expected in SENT_AS.items():
        plain = post(gateway, replica, key, json.dumps(CHAT).encode())
        assert json.loads(plain.body) == {**CHAT, "priority": expected}, key


def test_a_clients_own_priority_is_replaced_in_its_body_and_header(
    gateway: GatewayProcess, replica: FaultServer
) -> None:
    # Each client asks for more than its tenant has; a priority-0 tenant and an anonymous
    # client are sent 0 too, so that none of them jumps the engine's queue.
    for key, expected in SENT_AS.items():
        body = json.dumps({**CHAT, "priority": -1000}).encode()
        seen = post(gateway, replica, key, body, headers={"x-vllm-priority": "-1000"})
        assert json.loads(seen.body) == {**CHAT, "priority": expected}, key
        assert "x-vllm-priority" not in seen.headers


@pytest.mark.parametrize(
    "body",
    [
        # Spelled with an escape the gateway does not see as the key: its own comes after it,
        # and the last of duplicate keys is the one a JSON parser keeps.
        b'{"model": "emulated-model", "\\u0070riority": -1000, ' + _HI + b"}",
        b'{"model": "emulated-model", "priority": -1000, ' + _HI + b', "priority": -999}',
        b'{"model": "emulated-model", "messages": [{"role": "user", "content": "priority"}]}',
    ],
    ids=["escaped", "twice", "in-a-string"],
)
def test_no_spelling_of_the_key_gets_past_the_gateway(
    gateway: GatewayProcess, replica: FaultServer, body: bytes
) -> None:
    seen = post(gateway, replica, "batch-key", body)
    assert json.loads(seen.body)["priority"] == 1
    assert json.loads(seen.body)["model"] == MODEL


def test_every_endpoint_that_runs_the_model_carries_it(
    gateway: GatewayProcess, replica: FaultServer
) -> None:
    bodies: dict[str, dict[str, Any]] = {
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
        "/v1/completions": {"prompt": "hi", "stream": True},
        "/v1/responses": {"input": "hi"},
        "/v1/embeddings": {"input": "hi", "priority": 7},
        "/pooling": {"input": "hi"},
        "/classify": {"input": "hi"},
        "/v2/embed": {"texts": ["hi"], "input_type": "query"},
        "/score": {"text_1": "a", "text_2": "b"},
        "/rerank": {"query": "a", "documents": ["b"]},
        "/tokenize": {"prompt": "hi", "priority": 7},
        "/detokenize": {"tokens": [1, 2]},
    }
    for path, fields in bodies.items():
        body = json.dumps({"model": MODEL, **fields}).encode()
        seen = post(gateway, replica, "interactive-key", body, path)
        if path in ("/tokenize", "/detokenize"):
            assert seen.body == body, path  # no model runs: the body goes as sent
        else:
            assert json.loads(seen.body) == {"model": MODEL, **fields, "priority": -2}, path


def test_without_the_flag_a_clients_priority_is_dropped_unless_the_operator_allows_it(
    replica: FaultServer, config: Path
) -> None:
    body = json.dumps({**CHAT, "priority": -1000}).encode()
    with GatewayProcess([f"{MODEL}={replica.url}"], *gateway_args(config)) as plain:
        for key in SENT_AS:
            seen = post(plain, replica, key, body, headers={"x-vllm-priority": "-1000"})
            assert json.loads(seen.body) == CHAT, key
            assert "x-vllm-priority" not in seen.headers, key
    allowing = gateway_args(config, "--engine-control", "priority")
    with GatewayProcess([f"{MODEL}={replica.url}"], *allowing) as open_to_clients:
        for key in SENT_AS:
            seen = post(open_to_clients, replica, key, body, headers={"x-vllm-priority": "-1000"})
            assert seen.body == body, key
            assert seen.headers["x-vllm-priority"] == "-1000", key


def test_it_composes_with_the_other_rewrites(replica: FaultServer, config: Path) -> None:
    flags = ("--forward-priority", "--isolate-tenants", "--observe-usage")
    with GatewayProcess([f"{MODEL}={replica.url}"], *gateway_args(config, *flags)) as both:
        body = json.dumps({**CHAT, "stream": True}).encode()
        seen = json.loads(post(both, replica, "interactive-key", body).body)
        assert seen["priority"] == -2
        assert seen["stream_options"] == {"include_usage": True}
        assert seen["cache_salt"]
        assert {key: seen[key] for key in CHAT} == CHAT


def test_emulated_replicas_answer_the_rewritten_requests(config: Path) -> None:
    with (
        EmulatedReplicas(2, MODEL) as fleet,
        GatewayProcess(fleet.urls, *gateway_args(config, "--forward-priority")) as gateway,
    ):
        for key in SENT_AS:
            with openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0) as client:
                stream = client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": f"a question from {key}"}],
                    max_tokens=4,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"priority": -1000},
                )
                chunks = list(stream)
                assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
                completion = client.completions.create(model=MODEL, prompt="hello", max_tokens=2)
                assert completion.usage is not None and completion.usage.completion_tokens == 2


def test_a_priority_beyond_vllms_range_is_a_start_up_error(tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    huge = {"name": "huge", "api_key": "k", "priority": 2**63}
    config.write_text(yaml.safe_dump({"backend": ["http://a:1"], "tenants": [huge]}))
    environ = {"GATEWAY_CONFIG": str(config)}
    assert load_settings(environ=environ).tenants[0].priority == 2**63  # not forwarded: kept
    with pytest.raises(ConfigError, match=r"tenants\[0\] \(huge\): with forward_priority"):
        load_settings(environ={**environ, "GATEWAY_FORWARD_PRIORITY": "true"})
