"""The endpoints routed by model alone (`Endpoint.by_prefix` false), each sent through a real
gateway in front of emulated replicas that serve them (`--pooling`): vLLM's answers come back
from a replica of the body's model; the gateway's own errors keep the OpenAI shape.

Two replicas serve `MODEL` and one `OTHER`, so that which replica answers says the model chose
the pool. The official client has no method for these paths: they are sent with httpx, and
its embeddings call is the reference the pooled vectors are checked against.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from prefix_gateway.emulator.replicas import EmulatedReplicas
from prefix_gateway.emulator.tokenizer import encode
from prefix_gateway.prompt.parsing import Endpoint
from tests.conftest import MODEL
from tests.support import PATIENCE_SECONDS, GatewayProcess

OTHER = "other-model"
KEY = "client-key"
TEXT = "river stone light"
TEXT_IDS = encode(TEXT)
"""Three of the words the replicas generate, which `/detokenize` gives back."""

BODIES: dict[str, dict[str, Any]] = {
    "/tokenize": {"prompt": TEXT},
    "/detokenize": {"tokens": TEXT_IDS},
    "/score": {"text_1": TEXT, "text_2": [TEXT, "garden bridge"]},
    "/v1/score": {"queries": [TEXT, "north"], "documents": [TEXT, "garden bridge"]},
    "/rerank": {"query": TEXT, "documents": ["garden bridge", TEXT, "north"]},
    "/v1/rerank": {"query": TEXT, "documents": ["garden bridge", TEXT, "north"], "top_n": 2},
    "/v2/rerank": {"query": TEXT, "documents": [TEXT]},
    "/pooling": {"input": [TEXT, "garden bridge"]},
    "/classify": {"input": [TEXT, "north"]},
    "/v2/embed": {"texts": [TEXT], "embedding_types": ["float", "ubinary"]},
}


@pytest.fixture(scope="module")
def served() -> Iterator[EmulatedReplicas]:
    with EmulatedReplicas(2, MODEL, ["--pooling"]) as replicas:
        yield replicas


@pytest.fixture(scope="module")
def other() -> Iterator[EmulatedReplicas]:
    with EmulatedReplicas(1, OTHER, ["--pooling"]) as replicas:
        yield replicas


@pytest.fixture(scope="module")
def gateway(served: EmulatedReplicas, other: EmulatedReplicas) -> Iterator[GatewayProcess]:
    with GatewayProcess(served.urls + other.urls) as started:
        yield started


@pytest.fixture(scope="module")
def embeddings(gateway: GatewayProcess) -> Callable[[str], list[float]]:
    """The embedding of a text, asked of the same replicas with the official client."""
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)

    def embed(text: str) -> list[float]:
        return client.embeddings.create(model=MODEL, input=text).data[0].embedding

    return embed


def _backends(replicas: EmulatedReplicas) -> set[str]:
    return {urlsplit(url).netloc for url in replicas.urls}


def _post(gateway: GatewayProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(gateway.url + path, json=body, timeout=30)


def _error(response: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = response.json()["error"]
    assert {"message", "type", "code"} <= set(error), error
    return error


def test_every_model_only_endpoint_is_covered() -> None:
    # Anthropic's count_tokens answers errors in Anthropic's shape: tests/test_messages.py.
    routed = {e.value for e in Endpoint if not e.by_prefix and not e.anthropic}
    assert set(BODIES) == routed


@pytest.mark.parametrize("path", list(BODIES))
def test_each_is_answered_by_a_replica_of_the_model(
    gateway: GatewayProcess, served: EmulatedReplicas, other: EmulatedReplicas, path: str
) -> None:
    for model, replicas in ((MODEL, served), (OTHER, other)):
        reply = _post(gateway, path, {"model": model, **BODIES[path]})
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-gateway-backend"] in _backends(replicas)
        assert reply.headers["x-gateway-route"] == "least_loaded"
        if path != "/detokenize" and path != "/tokenize":
            assert reply.json().get("model", model) == model


def test_tokenize_and_detokenize(gateway: GatewayProcess) -> None:
    tokenized = _post(gateway, "/tokenize", {"model": MODEL, **BODIES["/tokenize"]}).json()
    assert tokenized["tokens"] == TEXT_IDS and tokenized["count"] == 3
    assert tokenized["token_strs"] is None and tokenized["max_model_len"] > 3
    detokenized = _post(gateway, "/detokenize", {"model": MODEL, "tokens": TEXT_IDS})
    assert detokenized.json() == {"prompt": TEXT}


def test_score_pairs_one_to_many_and_many_to_many(gateway: GatewayProcess) -> None:
    # `/score` pairs one text with two, `/v1/score` two with two: two scores each.
    for path in ("/score", "/v1/score"):
        answer = _post(gateway, path, {"model": MODEL, **BODIES[path]}).json()
        assert answer["id"].startswith("score-") and answer["object"] == "list"
        assert [item["index"] for item in answer["data"]] == [0, 1]
        assert {item["object"] for item in answer["data"]} == {"score"}
        assert answer["data"][0]["score"] == pytest.approx(1.0)  # the text against itself
        assert 0.0 <= answer["data"][1]["score"] < 1.0
        usage = answer["usage"]
        assert usage["prompt_tokens"] == usage["total_tokens"] > 0
        assert usage["completion_tokens"] == 0
    mismatched = {"model": MODEL, "text_1": ["a", "b"], "text_2": ["c", "d", "e"]}
    refused = _post(gateway, "/score", mismatched)
    assert refused.status_code == 400 and refused.headers["x-gateway-backend"]
    assert _error(refused)["type"] == "BadRequestError"


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_puts_the_most_relevant_document_first(gateway: GatewayProcess, path: str) -> None:
    body = BODIES[path]
    answer = _post(gateway, path, {"model": MODEL, **body}).json()
    assert answer["id"].startswith("score-") and answer["model"] == MODEL
    results = answer["results"]
    assert len(results) == (body.get("top_n") or len(body["documents"]))
    first = results[0]
    assert first["document"] == {"text": TEXT, "multi_modal": None}
    assert body["documents"][first["index"]] == TEXT
    assert first["relevance_score"] == pytest.approx(1.0)
    scores = [result["relevance_score"] for result in results]
    assert scores == sorted(scores, reverse=True)
    assert answer["usage"]["prompt_tokens"] == answer["usage"]["total_tokens"] > 0


def test_pooling_and_cohere_embed_give_the_embeddings(
    gateway: GatewayProcess, embeddings: Callable[[str], list[float]]
) -> None:
    pooled = _post(gateway, "/pooling", {"model": MODEL, **BODIES["/pooling"]}).json()
    assert pooled["id"].startswith("pooling-") and pooled["object"] == "list"
    assert [item["object"] for item in pooled["data"]] == ["pooling", "pooling"]
    assert pooled["data"][0]["data"] == pytest.approx(embeddings(TEXT))
    assert pooled["data"][1]["data"] == pytest.approx(embeddings("garden bridge"))
    assert pooled["usage"]["prompt_tokens"] == 3 + 2

    cohere = _post(gateway, "/v2/embed", {"model": MODEL, **BODIES["/v2/embed"]}).json()
    assert cohere["id"].startswith("embd-")
    assert cohere["response_type"] == "embeddings_by_type" and cohere["texts"] == [TEXT]
    assert set(cohere["embeddings"]) == {"float", "ubinary"}
    vector = embeddings(TEXT)
    assert cohere["embeddings"]["float"][0] == pytest.approx(vector)
    bits = "".join("1" if value >= 0 else "0" for value in vector)
    assert cohere["embeddings"]["ubinary"][0] == [
        int(bits[start : start + 8], 2) for start in range(0, len(bits), 8)
    ]
    assert cohere["meta"] == {
        "api_version": {"version": "2"},
        "billed_units": {"input_tokens": 3, "image_tokens": 0},
    }


def test_classify_gives_probabilities_and_a_label(gateway: GatewayProcess) -> None:
    answer = _post(gateway, "/classify", {"model": MODEL, **BODIES["/classify"]}).json()
    assert answer["id"].startswith("classify-") and answer["object"] == "list"
    assert [item["index"] for item in answer["data"]] == [0, 1]
    for item in answer["data"]:
        assert item["num_classes"] == len(item["probs"]) == 2
        assert sum(item["probs"]) == pytest.approx(1.0)
        assert item["label"] == f"LABEL_{item['probs'].index(max(item['probs']))}"
    assert answer["usage"]["prompt_tokens"] == 3 + 1


@pytest.mark.parametrize("path", list(BODIES))
def test_an_unknown_model_is_the_gateways_openai_404(gateway: GatewayProcess, path: str) -> None:
    reply = _post(gateway, path, {**BODIES[path], "model": "no-such-model"})
    assert reply.status_code == 404
    error = _error(reply)
    assert error["code"] == "model_not_found" and error["type"] == "invalid_request_error"
    assert "x-gateway-backend" not in reply.headers


@pytest.mark.parametrize("path", list(BODIES))
def test_a_body_that_is_not_json_is_a_400(gateway: GatewayProcess, path: str) -> None:
    cut = b'{"model": "' + MODEL.encode() + b'", "inp'
    json_type = {"content-type": "application/json"}
    reply = httpx.post(gateway.url + path, content=cut, headers=json_type, timeout=PATIENCE_SECONDS)
    assert reply.status_code == 400
    assert _error(reply)["code"] == "invalid_json"
    assert "x-gateway-backend" not in reply.headers


def test_a_client_key_guards_each_of_them(served: EmulatedReplicas) -> None:
    with GatewayProcess(served.urls, "--api-key", KEY) as guarded:
        for path, body in BODIES.items():
            missing = _post(guarded, path, {"model": MODEL, **body})
            assert missing.status_code == 401, path
            assert missing.headers["www-authenticate"] == "Bearer"
            assert _error(missing)["code"] == "missing_api_key"
            keyed = httpx.post(
                guarded.url + path,
                json={"model": MODEL, **body},
                headers={"authorization": f"Bearer {KEY}"},
                timeout=PATIENCE_SECONDS,
            )
            assert keyed.status_code == 200, (path, keyed.text)
