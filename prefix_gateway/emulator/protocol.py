"""OpenAI request bodies checked and turned into the values the engine runs on: a field of the
wrong type is a 400, an unknown model a 404, fields not modelled are ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from prefix_gateway.emulator.config import EmulatorConfig
from prefix_gateway.emulator.errors import InvalidRequest, NotFound
from prefix_gateway.emulator.prompts import chat_prompt_ids, completion_prompts

EMBEDDING_DIMENSIONS = 32


@dataclass(frozen=True)
class GenerationRequest:
    kind: Literal["chat", "completion"]
    prompts: list[list[int]]
    max_tokens: list[int]
    stream: bool
    include_usage: bool
    cache_salt: str | None = None


@dataclass(frozen=True)
class EmbeddingRequest:
    inputs: list[list[int]]
    base64: bool


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return body


def check_model(body: Mapping[str, Any], config: EmulatorConfig) -> None:
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise InvalidRequest("model must be a string", param="model")
    if model != config.model:
        raise NotFound(f"The model `{model}` does not exist.", param="model")


def parse_chat(body: Mapping[str, Any], config: EmulatorConfig) -> GenerationRequest:
    check_model(body, config)
    prompt = chat_prompt_ids(body.get("messages"), body.get("tools"), config.chat_template)
    requested = optional_positive_int(body, "max_completion_tokens")
    if requested is None:
        requested = optional_positive_int(body, "max_tokens")
    return _generation("chat", [prompt], requested, body, config)


def parse_completion(body: Mapping[str, Any], config: EmulatorConfig) -> GenerationRequest:
    check_model(body, config)
    prompts = completion_prompts(body.get("prompt"))
    requested = optional_positive_int(body, "max_tokens")
    return _generation("completion", prompts, requested, body, config)


def parse_embedding(body: Mapping[str, Any], config: EmulatorConfig) -> EmbeddingRequest:
    check_model(body, config)
    inputs = completion_prompts(body.get("input"), param="input")
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise InvalidRequest('encoding_format must be "float" or "base64"', param="encoding_format")
    dimensions = body.get("dimensions")
    if dimensions is not None and dimensions != EMBEDDING_DIMENSIONS:
        raise InvalidRequest(
            f"this model only makes {EMBEDDING_DIMENSIONS}-dimensional embeddings",
            param="dimensions",
        )
    return EmbeddingRequest(inputs=inputs, base64=encoding == "base64")


def parse_tokenize(body: Mapping[str, Any], config: EmulatorConfig) -> list[int]:
    """The token ids of `/tokenize`'s `messages` (as chat renders them) or `prompt`."""
    check_model(body, config)
    if "messages" in body:
        return chat_prompt_ids(body.get("messages"), body.get("tools"), config.chat_template)
    return completion_prompts(body.get("prompt"))[0]


def parse_detokenize(body: Mapping[str, Any], config: EmulatorConfig) -> list[int]:
    """`/detokenize`'s `tokens`: ids from 0 to 2**63-1, as vLLM takes them."""
    check_model(body, config)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(token, int) and not isinstance(token, bool) and 0 <= token < 2**63
        for token in tokens
    ):
        raise InvalidRequest("tokens must be a list of token ids (integers >= 0)", param="tokens")
    return tokens


def _generation(
    kind: Literal["chat", "completion"],
    prompts: list[list[int]],
    requested: int | None,
    body: Mapping[str, Any],
    config: EmulatorConfig,
) -> GenerationRequest:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest("stream must be a boolean", param="stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, Mapping):
        raise InvalidRequest("stream_options must be an object", param="stream_options")
    include_usage = bool(options and options.get("include_usage"))
    n = body.get("n", 1)
    if n != 1 and n is not None:
        raise InvalidRequest("only n=1 is supported", param="n")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise InvalidRequest("cache_salt must be a non-empty string", param="cache_salt")
    prompt_param = "messages" if kind == "chat" else "prompt"
    limits = [completion_limit(len(prompt), requested, config, prompt_param) for prompt in prompts]
    kept_salt = salt if config.honour_cache_salt else None
    return GenerationRequest(kind, prompts, limits, stream, include_usage, kept_salt)


def completion_limit(
    prompt_tokens: int, requested: int | None, config: EmulatorConfig, prompt_param: str
) -> int:
    """The tokens to generate: as `requested` (or the default), if the context has room."""
    room = config.max_model_len - prompt_tokens
    if prompt_tokens < 1:
        raise InvalidRequest("the prompt is empty: it has no tokens", param=prompt_param)
    if requested is None:
        requested = min(config.default_max_tokens, room)
    if requested < 1 or requested > room:
        raise InvalidRequest(
            f"This model's maximum context length is {config.max_model_len} tokens. However, "
            f"you requested {prompt_tokens + max(requested, 1)} tokens ({prompt_tokens} in the "
            f"messages, {max(requested, 1)} in the completion). Please reduce the length of the "
            "messages or completion.",
            param="max_tokens",
        )
    return requested


def optional_positive_int(body: Mapping[str, Any], name: str) -> int | None:
    """A positive count, read as vLLM's pydantic models read one in lax mode: `2000`,
    `2000.0` and `"2000"` alike."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            value = None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidRequest(f"{name} must be a positive integer", param=name)
    return value
