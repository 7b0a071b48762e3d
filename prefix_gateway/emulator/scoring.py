"""Score and rerank as vLLM serves them for a cross-encoder (`/score`, `/v1/score`, `/rerank`,
`/v1/rerank`, `/v2/rerank`). The relevance of a document to a query is the cosine of the
embeddings the emulator gives the two texts (`/v1/embeddings`), taken from [-1, 1] to [0, 1]:
a text scores 1 against itself, and a client can check a ranking against the embeddings.
A pair's prompt is the tokens of both texts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from prefix_gateway.emulator.bodies import embedding, pooling_list
from prefix_gateway.emulator.config import EmulatorConfig
from prefix_gateway.emulator.errors import InvalidRequest
from prefix_gateway.emulator.protocol import check_model
from prefix_gateway.emulator.tokenizer import encode

_SIDES = (
    ("queries", "documents"),
    ("queries", "items"),
    ("data_1", "data_2"),
    ("text_1", "text_2"),
)
"""The fields a score request may name its two sides with, in the order vLLM tries them."""


class _Pairs:
    """Each query with its document, 1:1, 1:N or N:N, as vLLM pairs them."""

    def __init__(self, queries: list[str], documents: list[str]) -> None:
        if len(queries) > 1 and len(queries) != len(documents):
            raise InvalidRequest("Input lengths must be either 1:1, 1:N or N:N")
        if not queries:
            raise InvalidRequest("At least one text element must be given")
        if not documents:
            raise InvalidRequest("At least one text_pair element must be given")
        self.documents = documents
        firsts = queries * len(documents) if len(queries) == 1 else queries
        ids = {text: encode(text) for text in (*queries, *documents)}
        self.prompt_tokens = sum(
            len(ids[query]) + len(ids[document])
            for query, document in zip(firsts, documents, strict=True)
        )
        vectors = {text: embedding(token_ids) for text, token_ids in ids.items()}
        self.scores = [
            relevance(vectors[query], vectors[document])
            for query, document in zip(firsts, documents, strict=True)
        ]


def relevance(query: list[float], document: list[float]) -> float:
    """The cosine of two unit vectors, from [-1, 1] to [0, 1]."""
    cosine = sum(a * b for a, b in zip(query, document, strict=True))
    return min(1.0, max(0.0, (1.0 + cosine) / 2.0))


def score_body(body: Mapping[str, Any], config: EmulatorConfig, ident: str) -> bytes:
    check_model(body, config)
    pairs = _Pairs(*_sides(body))
    data = [
        {"index": index, "object": "score", "score": score}
        for index, score in enumerate(pairs.scores)
    ]
    return pooling_list(ident, config.model, data, pairs.prompt_tokens)


def rerank_body(body: Mapping[str, Any], config: EmulatorConfig, ident: str) -> bytes:
    """The documents by relevance to the query, the most relevant first (ties in their order),
    the first `top_n` of them when it is set."""
    check_model(body, config)
    query = body.get("query")
    if not isinstance(query, str):
        raise InvalidRequest("query must be a string", param="query")
    top_n = body.get("top_n", 0)
    if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0:
        raise InvalidRequest("top_n must be an integer >= 0", param="top_n")
    pairs = _Pairs([query], _texts(body.get("documents"), "documents"))
    ranked = sorted(enumerate(pairs.scores), key=lambda scored: -scored[1])
    results = [
        {
            "index": index,
            "document": {"text": pairs.documents[index], "multi_modal": None},
            "relevance_score": score,
        }
        for index, score in ranked
    ]
    kept = top_n or len(results)
    tokens = pairs.prompt_tokens
    return orjson.dumps(
        {
            "id": ident,
            "model": config.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "results": results[:kept],
        }
    )


def _sides(body: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    for first, second in _SIDES:
        if first in body and second in body:
            return _texts(body[first], first), _texts(body[second], second)
    raise InvalidRequest(
        "a score request needs queries and documents (or items), data_1 and data_2, or text_1"
        " and text_2"
    )


def _texts(value: object, param: str) -> list[str]:
    """A side given as one text or a list of texts (vLLM takes images too, for multi-modal
    models only)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return list(value)
    if isinstance(value, dict) or (
        isinstance(value, list) and any(isinstance(item, dict) for item in value)
    ):
        raise InvalidRequest(
            "multi-modal score inputs are not supported by this model", param=param
        )
    raise InvalidRequest(f"{param} must be a string or a list of strings", param=param)
