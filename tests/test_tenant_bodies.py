"""Under `--isolate-tenants`: a stored response's `cancel` (sent with no body by the official
client) reaches its replica, a hostile cancel body is refused by the same limits as every other
body, and the tenant's `cache_salt` goes wherever the engine keys its cache with one."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from prefix_gateway.emulator.replicas import EmulatedReplicas
from tests.conftest import MODEL
from tests.fault_servers import FaultServer
from tests.support import PATIENCE_SECONDS, GatewayProcess

KEY = "tenant-key-one"
TENANTS = ("--api-key", KEY, "--isolate-tenants")


@pytest.fixture(scope="module")
def gateway() -> Iterator[GatewayProcess]:
    with (
        EmulatedReplicas(2, MODEL, ["--chat-template", "plain"]) as fleet,
        GatewayProcess(fleet.urls, *TENANTS) as started,
    ):
        yield started


def test_a_tenant_cancels_a_stored_response_with_the_official_client(
    gateway: GatewayProcess,
) -> None:
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0) as client:
        raw = client.responses.with_raw_response.create(
            model=MODEL, input="where is the glue?", max_output_tokens=4
        )
        response, backend = raw.parse(), raw.headers["x-gateway-backend"]
        # The replica's own answer, from the replica that stores it: a finished response
        # cannot be cancelled (the emulator, like vLLM, runs none in the background).
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.with_raw_response.cancel(response.id)
        assert refused.value.response.headers["x-gateway-backend"] == backend
        assert "Cannot cancel a synchronous response." in refused.value.message
        assert client.responses.retrieve(response.id).output_text == response.output_text


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"[" * 400_000 + b"]" * 400_000, 400, "too_many_values"),
        (b'{"a":' * 100 + b"1" + b"}" * 100, 400, "too_deep"),
        (b"not json", 400, "invalid_json"),
        (b"[1]", 400, "invalid_type"),
    ],
)
def test_a_hostile_cancel_body_is_refused_by_the_body_limits(
    gateway: GatewayProcess, body: bytes, status: int, code: str
) -> None:
    url = gateway.url + "/v1/responses/resp_0123456789abcdef/cancel"
    headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    answer = httpx.post(url, content=body, headers=headers, timeout=60)
    assert answer.status_code == status
    assert answer.json()["error"]["code"] == code
    # Requests beside it are served as before.
    chat = httpx.post(
        gateway.url + "/v1/chat/completions",
        headers=headers,
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=60,
    )
    assert chat.status_code == 200


def test_the_tenant_salt_goes_to_every_endpoint_whose_cache_vllm_salts() -> None:
    with FaultServer() as replica, GatewayProcess([f"{MODEL}={replica.url}"], *TENANTS) as gw:
        headers = {"authorization": f"Bearer {KEY}"}
        bodies: dict[str, dict[str, Any]] = {
            "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
            "/v1/embeddings": {"input": "hi", "cache_salt": "my-own"},
            "/pooling": {"input": "hi", "cache_salt": "my-own"},
            "/score": {"text_1": "a", "text_2": "b"},
            "/rerank": {"query": "a", "documents": ["b"]},
            "/tokenize": {"prompt": "hi", "cache_salt": "my-own"},
        }
        for path, body in bodies.items():
            answer = httpx.post(
                gw.url + path,
                headers=headers,
                json={"model": MODEL, **body},
                timeout=PATIENCE_SECONDS,
            )
            assert answer.status_code == 200, path
        salts = {
            request.path: json.loads(request.body).get("cache_salt") for request in replica.seen
        }
        tenant = salts["/v1/chat/completions"]
        assert tenant and tenant != "my-own"
        for path in ("/v1/embeddings", "/pooling", "/score", "/rerank"):
            assert salts[path] == tenant, path
        # Tokenizing computes nothing cached: the body goes as the client sent it.
        assert salts["/tokenize"] == "my-own"
