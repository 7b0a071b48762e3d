"""The probe prompt: a chat whose first message is new to every cache (a nonce), grown to the
length the block-size arithmetic asks for (`verdicts.probe_tokens`) by counting it with the
engine's own `/tokenize`, and the gateway's view of it: its tokens and block chain, worked out
by the same parsing and hashing as a routed request, so that the prediction the doctor judges
is the one routing makes.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

import orjson

from prefix_gateway.config import Settings
from prefix_gateway.prompt.hashing import chain_hashes, chain_seed
from prefix_gateway.prompt.parsing import Endpoint, RoutingInput, parse_request
from prefix_gateway.prompt.tokens import EngineTokenizer

# Words of at most six letters: one token each to many tokenizers, so the probe's length in
# tokens can be aimed at closely.
_FILLER = (
    "amber", "basket", "candle", "garden", "harbor", "island", "lamp", "meadow",
    "orange", "pepper", "river", "saddle", "timber", "valley", "window", "yellow",
)  # fmt: skip


def probe_messages(nonce: str, words: int) -> list[dict[str, str]]:
    filler = " ".join(_FILLER[index % len(_FILLER)] for index in range(max(0, words)))
    return [
        {"role": "system", "content": f"Probe {nonce} of prefix-gateway doctor. Say one word."},
        {"role": "user", "content": filler},
    ]


def new_nonce() -> str:
    return secrets.token_hex(6)


def chat_body(
    model: str, messages: list[dict[str, str]], cache_salt: str | None = None
) -> dict[str, Any]:
    """A chat request costing one generated token."""
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": 1,
        "temperature": 0,
    }
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return body


@dataclass(frozen=True)
class GatewayView:
    """How routing sees a probe: its prompt tokens (counted with `--tokenizer`, else estimated
    from its characters) and the chain of block hashes the index would hold for it."""

    request: RoutingInput
    chain: list[int]
    tokens: float
    characters: int

    @property
    def counted(self) -> bool:
        """The tokens are the engine tokenizer's (`--tokenizer`), not an estimate."""
        return self.request.tokens is not None


def gateway_view(
    settings: Settings, tokenizer: EngineTokenizer | None, body: dict[str, Any]
) -> GatewayView:
    request = parse_request(Endpoint.CHAT, orjson.dumps(body), None, tokenizer=tokenizer)
    hashed, block = request.hashed(settings.block_chars, settings.block_tokens)
    chain = chain_hashes(
        hashed, block, chain_seed(request.cache_salt), limit=settings.max_prompt_blocks
    )
    tokens = request.estimated_tokens(settings.chars_per_token)
    return GatewayView(request, chain, tokens, len(request.canonical))
