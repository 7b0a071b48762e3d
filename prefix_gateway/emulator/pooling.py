"""What vLLM serves for a pooling model besides `/v1/embeddings`, in its shapes: `/pooling`
(each input's pooled vector), `/classify` (each input's class probabilities) and Cohere's
`/v2/embed`. The vectors are the emulator's embeddings, so these endpoints and
`/v1/embeddings` agree on a text. Like embeddings they are answered at once: nothing of them
goes through the engine's cache or time model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import orjson

from prefix_gateway.emulator.bodies import base64_floats, embedding, pooling_list
from prefix_gateway.emulator.config import EmulatorConfig
from prefix_gateway.emulator.errors import InvalidRequest
from prefix_gateway.emulator.prompts import chat_prompt_ids, completion_prompts, content_ids
from prefix_gateway.emulator.protocol import EMBEDDING_DIMENSIONS, check_model

CLASS_LABELS = ("LABEL_0", "LABEL_1")
"""The classes' names: Hugging Face's for a model whose configuration names none."""
EMBEDDING_TYPES = ("float", "binary", "ubinary", "base64")
"""Cohere's embedding types, in the order vLLM answers them."""
_TASKS = ("embed", "classify")
_SHARPNESS = 8.0
"""Scales the two components a class logit is read from: unit vectors' components are small,
and probabilities all near one half would tell nothing."""


def pooling_body(body: Mapping[str, Any], config: EmulatorConfig, ident: str) -> bytes:
    """`/pooling`: the embedding of each input (task `embed`, the model's own), or its class
    probabilities (task `classify`)."""
    check_model(body, config)
    task = body.get("task")
    if task is not None and task not in _TASKS:
        raise InvalidRequest(f"Unsupported task: {task!r} Supported tasks: {_TASKS}", param="task")
    if body.get("dimensions") is not None:
        raise InvalidRequest("dimensions is currently not supported", param="dimensions")
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise InvalidRequest('encoding_format must be "float" or "base64"', param="encoding_format")
    inputs = pooling_inputs(body, config)
    data = []
    for index, ids in enumerate(inputs):
        vector = class_probabilities(ids) if task == "classify" else embedding(ids)
        pooled = base64_floats(vector) if encoding == "base64" else vector
        data.append({"index": index, "object": "pooling", "data": pooled})
    return pooling_list(ident, config.model, data, sum(map(len, inputs)))


def classify_body(body: Mapping[str, Any], config: EmulatorConfig, ident: str) -> bytes:
    check_model(body, config)
    inputs = pooling_inputs(body, config)
    data = []
    for index, ids in enumerate(inputs):
        probabilities = class_probabilities(ids)
        predicted = probabilities.index(max(probabilities))
        data.append(
            {
                "index": index,
                "label": CLASS_LABELS[predicted],
                "probs": probabilities,
                "num_classes": len(probabilities),
            }
        )
    return pooling_list(ident, config.model, data, sum(map(len, inputs)))


def cohere_embed_body(body: Mapping[str, Any], config: EmulatorConfig, ident: str) -> bytes:
    """`/v2/embed`, Cohere's embed API as vLLM serves it: `texts`, `images` or `inputs`, each
    embedding in every one of `embedding_types` asked for."""
    check_model(body, config)
    dimension = body.get("output_dimension")
    if dimension is not None and dimension != EMBEDDING_DIMENSIONS:
        raise InvalidRequest(
            f"this model only makes {EMBEDDING_DIMENSIONS}-dimensional embeddings",
            param="output_dimension",
        )
    kinds = body.get("embedding_types") or ["float"]
    if not isinstance(kinds, list) or not all(kind in EMBEDDING_TYPES for kind in kinds):
        raise InvalidRequest(
            f"embedding_types must be a list of {', '.join(EMBEDDING_TYPES)}",
            param="embedding_types",
        )
    inputs, with_images = _cohere_inputs(body)
    vectors = [embedding(ids) for ids in inputs]
    tokens = sum(map(len, inputs))
    image_tokens = tokens if with_images else 0
    answer: dict[str, Any] = {
        "id": ident,
        "embeddings": {kind: _typed(vectors, kind) for kind in EMBEDDING_TYPES if kind in kinds},
    }
    if body.get("texts") is not None:
        answer["texts"] = body["texts"]
    answer["meta"] = {
        "api_version": {"version": "2"},
        "billed_units": {"input_tokens": tokens - image_tokens, "image_tokens": image_tokens},
    }
    answer["response_type"] = "embeddings_by_type"
    return orjson.dumps(answer)


def pooling_inputs(body: Mapping[str, Any], config: EmulatorConfig) -> list[list[int]]:
    """The token ids of each input: `input` as completions take a prompt, or one chat of
    `messages`."""
    if "messages" in body:
        return [chat_prompt_ids(body.get("messages"), body.get("tools"), config.chat_template)]
    return completion_prompts(body.get("input"), param="input")


def class_probabilities(token_ids: list[int]) -> list[float]:
    """A softmax over two logits read from the embedding of `token_ids`."""
    vector = embedding(token_ids)
    logits = [_SHARPNESS * value for value in vector[: len(CLASS_LABELS)]]
    top = max(logits)
    weights = [math.exp(logit - top) for logit in logits]
    total = sum(weights)
    return [weight / total for weight in weights]


def _cohere_inputs(body: Mapping[str, Any]) -> tuple[list[list[int]], bool]:
    """The token ids of each input, and whether an image is among them (an image is one
    token, as in chat content)."""
    given = [name for name in ("texts", "images", "inputs") if body.get(name) is not None]
    value = body.get(given[0]) if len(given) == 1 else None
    if not isinstance(value, list) or not value:
        raise InvalidRequest(
            "Exactly one of texts, images, or inputs must be provided, and it must be non-empty"
        )
    name = given[0]
    if name == "texts":
        parts: list[object] = [[{"type": "text", "text": text}] for text in value]
    elif name == "images":
        parts = [[{"type": "image_url", "image_url": {"url": image}}] for image in value]
    else:
        parts = [item.get("content") if isinstance(item, dict) else None for item in value]
    inputs = []
    for index, content in enumerate(parts):
        if not isinstance(content, list) or not content:
            raise InvalidRequest(f"{name}[{index}] must hold content", param=name)
        inputs.append(content_ids(content, f"{name}[{index}]", param=name))
    with_images = any(
        isinstance(part, dict) and part.get("type") == "image_url"
        for content in parts
        if isinstance(content, list)
        for part in content
    )
    return inputs, with_images


def _typed(vectors: list[list[float]], kind: str) -> list[Any]:
    if kind == "float":
        return vectors
    if kind == "base64":
        return [base64_floats(vector) for vector in vectors]
    return [_bits(vector, signed=kind == "binary") for vector in vectors]


def _bits(vector: list[float], signed: bool) -> list[int]:
    """Each component's sign as a bit (1 for >= 0), eight to a byte, the first the highest;
    `binary` bytes are signed (less 128), `ubinary` not."""
    packed = []
    for start in range(0, len(vector), 8):
        byte = 0
        for value in vector[start : start + 8]:
            byte = byte << 1 | (value >= 0)
        packed.append(byte - 128 if signed else byte)
    return packed
