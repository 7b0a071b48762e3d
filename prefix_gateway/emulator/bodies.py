"""Response bodies and stream chunks in the shapes of vLLM's OpenAI server."""

from __future__ import annotations

import base64
import random
import sys
import time
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash

from prefix_gateway.emulator.protocol import EMBEDDING_DIMENSIONS

DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.prompt_tokens + other.prompt_tokens,
            self.completion_tokens + other.completion_tokens,
            self.cached_tokens + other.cached_tokens,
        )

    def as_dict(self, details: bool = True) -> dict[str, Any]:
        """`details`: with `prompt_tokens_details` (vLLM --enable-prompt-tokens-details)."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "completion_tokens": self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens} if details else None,
        }


@dataclass(frozen=True)
class Envelope:
    """What every body or chunk of one response repeats."""

    kind: str
    id: str
    created: int
    model: str
    details: bool = True
    """Usage carries `prompt_tokens_details` (the cached tokens)."""

    @property
    def is_chat(self) -> bool:
        return self.kind == "chat"

    def head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def body(self, texts: Sequence[str], usage: Usage) -> bytes:
        if self.is_chat:
            choices: list[dict[str, Any]] = [
                {
                    "index": index,
                    "message": {"role": "assistant", "content": text, "tool_calls": []},
                    "logprobs": None,
                    "finish_reason": "length",
                    "stop_reason": None,
                }
                for index, text in enumerate(texts)
            ]
            obj = "chat.completion"
        else:
            choices = [
                {
                    "index": index,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": "length",
                    "stop_reason": None,
                }
                for index, text in enumerate(texts)
            ]
            obj = "text_completion"
        return orjson.dumps(
            {**self.head(obj), "choices": choices, "usage": usage.as_dict(self.details)}
        )

    def chunk(self, index: int, text: str, *, first: bool, last: bool) -> bytes:
        choice: dict[str, Any]
        if self.is_chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": None}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": text, "logprobs": None}
            obj = "text_completion"
        choice["finish_reason"] = "length" if last else None
        return _event({**self.head(obj), "choices": [choice]})

    def usage_chunk(self, usage: Usage) -> bytes:
        obj = "chat.completion.chunk" if self.is_chat else "text_completion"
        return _event({**self.head(obj), "choices": [], "usage": usage.as_dict(self.details)})


def embeddings_body(
    ident: str, created: int, model: str, inputs: Sequence[Sequence[int]], as_base64: bool
) -> bytes:
    data = []
    for index, ids in enumerate(inputs):
        vector = embedding(ids)
        encoded = base64_floats(vector) if as_base64 else vector
        data.append({"index": index, "object": "embedding", "embedding": encoded})
    prompt_tokens = sum(len(ids) for ids in inputs)
    return orjson.dumps(
        {
            "id": ident,
            "object": "list",
            "created": created,
            "model": model,
            "data": data,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "total_tokens": prompt_tokens,
                "completion_tokens": 0,
                "prompt_tokens_details": None,
            },
        }
    )


def embedding(token_ids: Sequence[int]) -> list[float]:
    """A unit vector that depends only on the token ids."""
    seed = xxhash.xxh3_64_intdigest(array("I", token_ids).tobytes())
    rng = random.Random(seed)
    vector = [rng.gauss(0.0, 1.0) for _ in range(EMBEDDING_DIMENSIONS)]
    norm = sum(value * value for value in vector) ** 0.5 or 1.0
    return [value / norm for value in vector]


def models_body(
    model: str, created: int, max_model_len: int, adapters: Mapping[str, str] | None = None
) -> bytes:
    """vLLM's model list: the base model, then each LoRA adapter (`root` its path, `parent`
    the base model)."""
    cards = [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": root,
            "parent": parent,
            "max_model_len": max_model_len if parent is None else None,
        }
        for name, root, parent in [
            (model, model, None),
            *((name, path, model) for name, path in (adapters or {}).items()),
        ]
    ]
    return orjson.dumps({"object": "list", "data": cards})


def tokenize_body(ids: list[int], max_model_len: int) -> bytes:
    """vLLM's `/tokenize` answer (this tokenizer has no token strings to give)."""
    return orjson.dumps(
        {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": None}
    )


def detokenize_body(text: str) -> bytes:
    return orjson.dumps({"prompt": text})


def pooling_list(ident: str, model: str, data: list[dict[str, Any]], prompt_tokens: int) -> bytes:
    """vLLM's list answer of a pooling request (pooled vectors, classes, scores)."""
    return orjson.dumps(
        {
            "id": ident,
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": data,
            "usage": pooling_usage(prompt_tokens),
        }
    )


def pooling_usage(prompt_tokens: int) -> dict[str, Any]:
    """vLLM's usage of a pooling request (scores, classes, pooled vectors): prompt tokens only."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def base64_floats(vector: list[float]) -> str:
    """`vector` as OpenAI's clients decode `encoding_format: "base64"`: little-endian float32."""
    return base64.b64encode(_little_endian_floats(vector)).decode()


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _little_endian_floats(vector: list[float]) -> bytes:
    packed = array("f", vector)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()
