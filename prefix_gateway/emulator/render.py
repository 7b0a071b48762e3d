"""vLLM's scale-out render endpoints: a chat or completions request turned into the token ids
the engine would run (`GenerateRequest`), without running it.

vLLM registers them only when started with `--enable-scale-out`; otherwise each answers 403
naming that flag, which is what a default `vllm serve` gives a router that asks. Routers
(vLLM's own) use the token ids to route on the engine's exact tokens. `sampling_params` holds
only what the emulator models (`n`, `max_tokens`); vLLM's carries every sampling field.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import orjson

from prefix_gateway.emulator.config import EmulatorConfig
from prefix_gateway.emulator.errors import EmulatorError
from prefix_gateway.emulator.protocol import GenerationRequest, parse_chat, parse_completion

Parse = Callable[[dict[str, Any], EmulatorConfig], GenerationRequest]
Rendering = Callable[[GenerationRequest, dict[str, Any], Callable[[str], str]], bytes]
"""A render endpoint's answer to a parsed request and its body, given how ids are made."""

SCALE_OUT_DISABLED = (
    "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."
)


class ScaleOutDisabled(EmulatorError):
    status = 403
    error_type = "PermissionDeniedError"

    def __init__(self) -> None:
        super().__init__(SCALE_OUT_DISABLED)


def rendered_chat(
    request: GenerationRequest, body: Mapping[str, Any], new_id: Callable[[str], str]
) -> bytes:
    """`/v1/chat/completions/render`'s answer: one `GenerateRequest`."""
    return orjson.dumps(_generate_request(new_id("chatcmpl"), request, 0, body))


def rendered_completions(
    request: GenerationRequest, body: Mapping[str, Any], new_id: Callable[[str], str]
) -> bytes:
    """`/v1/completions/render`'s answer: a list, one `GenerateRequest` per prompt (ids
    numbered after the first when there are several)."""
    base = new_id("cmpl")
    single = len(request.prompts) == 1
    return orjson.dumps(
        [
            _generate_request(base if single else f"{base}-{index}", request, index, body)
            for index in range(len(request.prompts))
        ]
    )


def _generate_request(
    request_id: str, request: GenerationRequest, index: int, body: Mapping[str, Any]
) -> dict[str, Any]:
    return {
        "request_id": request_id,
        "token_ids": request.prompts[index],
        "token_offsets": None,
        "features": None,
        "content_parts": None,
        "sampling_params": {"n": 1, "max_tokens": request.max_tokens[index]},
        "model": body.get("model"),
        "reasoning_ended": None,
        "reasoning_parser_kwargs": None,
        "return_token_ids": None,
        "output_mode": "tokens",
        "stream": request.stream,
        "stream_options": body.get("stream_options") if request.stream else None,
        "cache_salt": body.get("cache_salt"),
        "priority": body.get("priority", 0),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
    }


RENDERERS: dict[str, tuple[Parse, Rendering]] = {
    "/v1/chat/completions/render": (parse_chat, rendered_chat),
    "/v1/completions/render": (parse_completion, rendered_completions),
}
