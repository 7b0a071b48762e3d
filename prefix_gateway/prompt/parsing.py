"""Request parsing: OpenAI request bodies into what routing needs, parsed once and never
re-serialised (the bytes go upstream as the client sent them).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from prefix_gateway.config import Settings
from prefix_gateway.errors import BadRequest
from prefix_gateway.prompt.canonical import (
    MessageStream,
    checked_messages,
    message_role,
    message_segment,
    text_prompts,
    token_prompts,
    tool_calls_field,
    tools_block,
)
from prefix_gateway.prompt.hashing import key_hash
from prefix_gateway.prompt.json_body import json_object
from prefix_gateway.prompt.limits import answers_asked, completion_limit
from prefix_gateway.prompt.messages_api import chat_messages as messages_chat
from prefix_gateway.prompt.messages_api import messages_canonical, user_id
from prefix_gateway.prompt.responses_api import (
    chat_messages,
    checked_response_id,
    responses_canonical,
)
from prefix_gateway.prompt.tokens import TOKEN_BYTES, EngineTokenizer, pack


class Endpoint(Enum):
    """The POST endpoints of the proxy path (docs/endpoints.md says how each is routed)."""

    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    EMBEDDINGS = "/v1/embeddings"
    RESPONSES = "/v1/responses"
    MESSAGES = "/v1/messages"
    """Anthropic's Messages API (errors on it in Anthropic's shape)."""
    # Routed by model alone: what they carry is not a prompt an engine caches for later.
    TOKENIZE = "/tokenize"
    DETOKENIZE = "/detokenize"
    SCORE = "/score"
    SCORE_V1 = "/v1/score"
    RERANK = "/rerank"
    RERANK_V1 = "/v1/rerank"
    RERANK_V2 = "/v2/rerank"
    POOLING = "/pooling"
    CLASSIFY = "/classify"
    EMBED_V2 = "/v2/embed"
    COUNT_TOKENS = "/v1/messages/count_tokens"

    # Members are singletons: hashed by identity, a set or dict look-up stays in C (Enum's
    # own hash is a Python call, made several times a request).
    __hash__ = object.__hash__

    @property
    def anthropic(self) -> bool:
        """Anthropic's API: its clients expect its error shape."""
        return self is Endpoint.MESSAGES or self is Endpoint.COUNT_TOKENS

    @property
    def by_prefix(self) -> bool:
        """Routed by its prompt's prefix (else by model alone, to the least loaded replica)."""
        return self in _BY_PREFIX

    @property
    def generates(self) -> bool:
        """Generates text: a stream's usage applies to it."""
        return self in _GENERATES

    @property
    def salted(self) -> bool:
        """Runs the model on a prompt, whose cached blocks vLLM keys with `cache_salt`
        (pooling requests too since vLLM 0.11; docs/endpoints.md)."""
        return self not in _UNSALTED


_BY_PREFIX = frozenset(
    {
        Endpoint.CHAT,
        Endpoint.COMPLETIONS,
        Endpoint.EMBEDDINGS,
        Endpoint.RESPONSES,
        Endpoint.MESSAGES,
    }
)
_GENERATES = frozenset({Endpoint.CHAT, Endpoint.COMPLETIONS, Endpoint.RESPONSES, Endpoint.MESSAGES})
_UNSALTED = frozenset({Endpoint.TOKENIZE, Endpoint.DETOKENIZE, Endpoint.COUNT_TOKENS})
ENDPOINTS = {endpoint.value: endpoint for endpoint in Endpoint}


@dataclass(frozen=True, slots=True)
class BodyLimits:
    """What one request body may hold; past any of these it is refused with a 400."""

    depth: int = 64
    """Nesting of arrays and objects."""
    values: int = 300_000
    """JSON values, bounded before the body is parsed by its commas, `[` and `{` (every value
    but a container's first follows a comma; commas inside strings only add)."""
    messages: int = 10_000
    prompts: int = 2_048
    """Prompts in one completions or embeddings batch."""
    session_key_bytes: int = 512

    @classmethod
    def of(cls, settings: Settings) -> BodyLimits:
        return cls(
            settings.max_json_depth,
            settings.max_json_values,
            settings.max_messages,
            settings.max_batch_prompts,
            settings.max_session_key_bytes,
        )


@dataclass(slots=True)
class RoutingInput:
    endpoint: Endpoint
    model: str
    canonical: bytes
    # Byte offset where the part that tells requests apart begins (the first user message).
    distinct_from: int
    session_key: str | None
    """A hash of the client's session key (the key itself is kept nowhere)."""
    stream: bool
    wants_usage: bool
    tenant: str | None = None
    """Whose cache namespace the request is in, under tenant isolation."""
    previous_response_id: str | None = None
    """A Responses request's `previous_response_id`: only the replica that stored it can
    answer."""
    tokens: bytes | None = None
    """The prompt's token ids as the engine has them, packed (with `--tokenizer`): hashed in
    the engine's blocks instead of `canonical`."""
    cache_salt: str | None = None
    """The `cache_salt` the engine sees, whose cached blocks no other salt shares: the
    tenant's under tenant isolation (the gateway sets it), else the client's own."""
    first_turn: bool = False
    """A chat or Responses request with no answer after its first user message: nothing past
    `distinct_from` is its own history (unknown, so False, for a plain prompt)."""
    response_id: str | None = None
    """The stored response a `GET`, `DELETE` or `cancel` is about (it has no body to parse)."""
    max_tokens: int | None = None
    """The most tokens each answer may have, if the request says: the largest of its limits
    (reserved ahead against budgets)."""
    choices: int = 1
    """Answers generated for it (`n`, or `best_of` where larger)."""
    engine_fields: dict[str, Any] | None = None
    """The engine-control fields its body sets (`priority`, `request_id`,
    `kv_transfer_params`), as the client gave them; None when it sets none (most requests)."""
    owner: str | None = None
    """Whose stored responses it may name, and whose it stores: its cache namespace under
    tenant isolation, else its named tenant's (set once the tenant is known); None for
    anonymous requests, which share theirs."""

    def estimated_tokens(self, chars_per_token: float) -> float:
        """The prompt's tokens: counted with the engine's tokenizer, else estimated."""
        if self.tokens is not None:
            return len(self.tokens) / TOKEN_BYTES
        return len(self.canonical) / chars_per_token

    def hashed(self, block_chars: int, block_tokens: int) -> tuple[bytes, int]:
        """The bytes whose blocks are hashed, and a block's length in them."""
        if self.tokens is not None:
            return self.tokens, block_tokens * TOKEN_BYTES
        return self.canonical, block_chars


def parse_request(
    endpoint: Endpoint,
    body: bytes,
    session_header: str | None,
    default_model: str = "",
    session_from_user: bool = False,
    limits: BodyLimits = BodyLimits(),
    tenant: str | None = None,
    tokenizer: EngineTokenizer | None = None,
) -> RoutingInput:
    """What routing needs of `body`; a `BadRequest` for anything malformed or past `limits`
    (its values are counted before it is parsed, its depth checked before it is walked). With
    `tokenizer`, also the prompt's token ids."""
    payload = json_object(body, limits.values, limits.depth)
    model = payload.get("model", default_model or None)
    if model is None or model == "":
        raise BadRequest("you must provide a model parameter", param="model", code="missing_model")
    if not isinstance(model, str):
        raise BadRequest("model must be a string", param="model", code="invalid_type")
    stream = payload.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean", param="stream", code="invalid_type")
    options = payload.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("stream_options must be an object", param="stream_options")
    wants_usage = bool(options and options.get("include_usage"))

    previous = None
    first_turn = False
    if endpoint is Endpoint.CHAT:
        canonical, distinct_from, first_turn = _chat_canonical(payload, limits.messages)
    elif endpoint is Endpoint.COMPLETIONS:
        prompt = payload.get("prompt")
        canonical, distinct_from = _completion_canonical(prompt, "prompt", limits.prompts), 0
    elif endpoint is Endpoint.EMBEDDINGS:
        given = payload.get("input")
        canonical, distinct_from = _completion_canonical(given, "input", limits.prompts), 0
    elif endpoint is Endpoint.RESPONSES:
        canonical, distinct_from, first_turn = responses_canonical(payload, limits.messages)
        given_previous = payload.get("previous_response_id")
        if given_previous is not None:
            previous = checked_response_id(given_previous, "previous_response_id")
    elif endpoint is Endpoint.MESSAGES:
        canonical, distinct_from, first_turn = messages_canonical(payload, limits.messages)
    else:
        canonical, distinct_from = b"", 0

    return RoutingInput(
        endpoint=endpoint,
        model=model,
        canonical=canonical,
        distinct_from=distinct_from,
        session_key=_session_key(
            endpoint, payload, session_header, session_from_user, limits, tenant
        ),
        stream=bool(stream),
        wants_usage=wants_usage,
        tenant=tenant,
        previous_response_id=previous,
        tokens=None if tokenizer is None else _tokens(endpoint, payload, tokenizer),
        cache_salt=tenant if tenant is not None else _client_salt(endpoint, payload),
        first_turn=first_turn,
        max_tokens=completion_limit(payload),
        choices=answers_asked(payload),
        engine_fields=(
            _engine_fields(payload)
            if "priority" in payload or "request_id" in payload or "kv_transfer_params" in payload
            else None
        ),
        owner=tenant,
    )


def stored_response_request(
    response_id: str,
    query: bytes,
    tenant: str | None,
    body: bytes = b"",
    limits: BodyLimits = BodyLimits(),
) -> RoutingInput:
    """A request about the stored response `response_id` (checked here), as routing sees it.
    Its body, which routing does not need (a `cancel` is sent none), goes upstream only if it
    is empty or a JSON object within `limits`."""
    if body.strip():
        json_object(body, limits.values, limits.depth)
    return RoutingInput(
        endpoint=Endpoint.RESPONSES,
        model="",
        canonical=b"",
        distinct_from=0,
        session_key=None,
        stream=b"stream=true" in query.lower(),
        wants_usage=False,
        tenant=tenant,
        response_id=checked_response_id(response_id, "response_id"),
        owner=tenant,
    )


ENGINE_FIELDS = ("priority", "request_id", "kv_transfer_params")
"""Body fields that steer vLLM's engine rather than the answer: its queue order, its request
(and stored response) id, its KV-cache transfer between replicas."""


def _engine_fields(payload: dict[str, Any]) -> dict[str, Any]:
    """The `ENGINE_FIELDS` the body sets (looked for inline first: most set none)."""
    return {name: payload[name] for name in ENGINE_FIELDS if name in payload}


def _client_salt(endpoint: Endpoint, payload: dict[str, Any]) -> str | None:
    salt = payload.get("cache_salt")
    return salt if endpoint.salted and isinstance(salt, str) and salt else None


def _tokens(
    endpoint: Endpoint, payload: dict[str, Any], tokenizer: EngineTokenizer
) -> bytes | None:
    """The packed ids of a chat's, a Responses request's or a single completion's prompt (None
    for a batch, whose prompts are cached apart, or what the template cannot render)."""
    if endpoint is Endpoint.CHAT:
        return tokenizer.chat(payload["messages"], payload.get("tools"))
    if endpoint is Endpoint.RESPONSES or endpoint is Endpoint.MESSAGES:
        rendered = (
            chat_messages(payload)
            if endpoint is Endpoint.RESPONSES
            else messages_chat(payload, tokenizer.merges_inline_system)
        )
        return None if rendered is None else tokenizer.chat(*rendered)
    if endpoint is Endpoint.COMPLETIONS:
        prompt = payload["prompt"]
        if isinstance(prompt, str):
            return tokenizer.text(prompt)
        if isinstance(prompt[0], int):  # already token ids (checked by the canonical stream)
            try:
                return pack(prompt)
            except OverflowError:  # not ids any tokenizer makes: the engine refuses them
                return None
        if len(prompt) == 1 and isinstance(prompt[0], str):
            return tokenizer.text(prompt[0])
    return None


def _session_key(
    endpoint: Endpoint,
    payload: dict[str, Any],
    header: str | None,
    from_user: bool,
    limits: BodyLimits,
    tenant: str | None,
) -> str | None:
    key = header or None
    if endpoint.anthropic:
        key = key or user_id(payload)
    elif key is None:
        given = payload.get("prompt_cache_key")
        if given is not None:
            if not isinstance(given, str):
                raise BadRequest("prompt_cache_key must be a string", param="prompt_cache_key")
            key = given or None
        else:
            user = payload.get("user")
            if from_user and isinstance(user, str) and user:
                key = user
    if key is None:
        return None
    if len(key) > limits.session_key_bytes:
        raise BadRequest(
            f"the session key is longer than {limits.session_key_bytes} characters",
            param="metadata.user_id" if endpoint.anthropic else "prompt_cache_key",
            code="session_key_too_long",
        )
    return session_hash(key, tenant)


def session_hash(key: str, tenant: str | None = None) -> str:
    """What is kept of a session key: a hash, 16 hex digits (a tenant's own)."""
    return f"{key_hash(key if tenant is None else f'{tenant}:{key}'):016x}"


def _chat_canonical(payload: dict[str, Any], max_messages: int) -> tuple[bytes, int, bool]:
    """The canonical bytes, where the first user message begins, and whether no answer
    follows it."""
    messages = checked_messages(payload, max_messages)
    stream = MessageStream()
    tools = payload.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise BadRequest("tools must be a list", param="tools")
        stream.add(tools_block(tools))
    for position, message in enumerate(messages):
        role = message_role(message, position)
        extra = b""
        tool_calls = message.get("tool_calls")
        if tool_calls is not None:
            extra = tool_calls_field(tool_calls)
        try:
            segment = message_segment(role, message.get("content"), extra)
        except TypeError as exc:
            raise BadRequest(
                f"messages[{position}].content: {exc}", param="messages", code="invalid_type"
            ) from None
        stream.add(segment, role)
    return stream.result()


def _completion_canonical(prompt: Any, name: str, max_prompts: int) -> bytes:
    if isinstance(prompt, str):
        return prompt.encode()
    if isinstance(prompt, list) and prompt:
        if not isinstance(prompt[0], int) and len(prompt) > max_prompts:
            raise BadRequest(
                f"{name} holds more than {max_prompts} prompts", param=name, code="too_many_prompts"
            )
        if all(isinstance(item, str) for item in prompt):
            return text_prompts(prompt)
        if all(isinstance(item, int) and not isinstance(item, bool) for item in prompt):
            return token_prompts(prompt)
        if all(isinstance(item, list) for item in prompt):
            return token_prompts(prompt)
    raise BadRequest(
        f"{name} must be a string, a list of strings or a list of token ids",
        param=name,
        code="invalid_type",
    )
