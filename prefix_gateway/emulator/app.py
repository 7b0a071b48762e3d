"""The emulated replica's HTTP surface: a plain ASGI application with vLLM's OpenAI routes;
a client that disconnects cancels its generation at once, releasing its slot and blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

from prefix_gateway.emulator.adapters import AdapterCollector, Adapters, adapter_salt
from prefix_gateway.emulator.asgi import (
    SSE_HEADERS,
    ClientGone,
    Receive,
    Scope,
    Send,
    lifespan,
    read_body,
    respond,
    send_events,
    until_disconnect,
)
from prefix_gateway.emulator.bodies import (
    DONE,
    Envelope,
    Usage,
    detokenize_body,
    embeddings_body,
    models_body,
    tokenize_body,
)
from prefix_gateway.emulator.config import EmulatorConfig
from prefix_gateway.emulator.engine import Engine
from prefix_gateway.emulator.errors import (
    EmulatorError,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
)
from prefix_gateway.emulator.messages_api import MessagesAPI, error_body
from prefix_gateway.emulator.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from prefix_gateway.emulator.metrics import EngineMetrics
from prefix_gateway.emulator.pooling import classify_body, cohere_embed_body, pooling_body
from prefix_gateway.emulator.prefix_cache import PrefixCache
from prefix_gateway.emulator.protocol import (
    GenerationRequest,
    parse_body,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_embedding,
    parse_tokenize,
)
from prefix_gateway.emulator.render import RENDERERS, Parse, Rendering, ScaleOutDisabled
from prefix_gateway.emulator.responses_api import ResponsesAPI
from prefix_gateway.emulator.sampler import Sampler
from prefix_gateway.emulator.scoring import rerank_body, score_body
from prefix_gateway.emulator.timing import TimeModel
from prefix_gateway.emulator.tokenizer import decode

Handler = Callable[[Receive, Send], Awaitable[None]]
Creation = Callable[[dict[str, Any]], Awaitable[bytes | AsyncIterator[bytes]]]
"""What makes an answer to a body: its JSON, or (streamed) its events."""
PoolingAnswer = Callable[[dict[str, Any], EmulatorConfig, str], bytes]
"""A pooling endpoint's answer to a body, given the id it names itself with."""
_T = TypeVar("_T")

_STORED_RESPONSE = "/v1/responses/"
_MESSAGES = "/v1/messages"
_POOLING: dict[str, tuple[str, PoolingAnswer]] = {
    # path: (its answers' id prefix, as vLLM's, and what answers it)
    "/pooling": ("pooling", pooling_body),
    "/classify": ("classify", classify_body),
    "/v2/embed": ("embd", cohere_embed_body),
    "/score": ("score", score_body),
    "/v1/score": ("score", score_body),
    "/rerank": ("score", rerank_body),
    "/v1/rerank": ("score", rerank_body),
    "/v2/rerank": ("score", rerank_body),
}


class EmulatorApp:
    def __init__(self, config: EmulatorConfig) -> None:
        self.config = config
        self.metrics = EngineMetrics(config.model)
        self.engine = Engine(
            PrefixCache(config.cache_blocks, config.block_size),
            TimeModel(
                config.prefill_seconds_per_token, config.decode_seconds_per_token, config.slowdown
            ),
            Sampler(config.seed),
            max_running=config.max_running,
            observer=self.metrics,
        )
        self.metrics.watch(self.engine)
        self.adapters = Adapters(
            config.model,
            config.lora_modules,
            config.max_loras,
            config.lora_load_seconds,
            config.lora_swap_seconds,
        )
        self.metrics.registry.register(AdapterCollector(self.adapters, config.model))
        self._created = int(time.time())
        self._serial = itertools.count()
        self._id_prefix = os.urandom(4).hex()
        self.responses = ResponsesAPI(self.engine, config)
        self.messages = MessagesAPI(self.engine, config)
        self._routes: dict[str, tuple[str, Handler]] = {
            "/v1/chat/completions": ("POST", self._chat),
            "/v1/completions": ("POST", self._completions),
            "/v1/embeddings": ("POST", self._embeddings),
            "/v1/responses": ("POST", _created(self.responses.create)),
            "/v1/messages": ("POST", _created(self.messages.create)),
            "/v1/messages/count_tokens": ("POST", self._count_tokens),
            "/tokenize": ("POST", self._tokenize),
            "/detokenize": ("POST", self._detokenize),
            "/v1/models": ("GET", self._models),
            "/health": ("GET", self._health),
            "/metrics": ("GET", self._metrics),
            # Not vLLM's: lets tests and benchmarks hang the engine while /health still answers.
            "/emulator/stall": ("POST", self._stall),
            # Not vLLM's either: a replica that turns slower (or recovers) in the middle of a run.
            "/emulator/slowdown": ("POST", self._slow_down),
        }
        for path, (parse, rendering) in RENDERERS.items():
            self._routes[path] = ("POST", self._render(parse, rendering))
        if config.lora_enabled:
            self._routes["/v1/load_lora_adapter"] = ("POST", self._load_adapter)
            self._routes["/v1/unload_lora_adapter"] = ("POST", self._unload_adapter)
        if config.pooling:
            for path, (prefix, answer) in _POOLING.items():
                self._routes[path] = ("POST", self._pooled(prefix, answer))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "lifespan":
            await lifespan(receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            path: str = scope["path"]
            if path.startswith(_STORED_RESPONSE):
                await self._stored_response(scope["method"], path, send)
                return
            route = self._routes.get(path)
            if route is None:
                raise NotFound(f"Not Found: {path}")
            method, handler = route
            if scope["method"] != method and not (method == "GET" and scope["method"] == "HEAD"):
                raise MethodNotAllowed(f"Method Not Allowed: use {method}")
            await handler(receive, send)
        except EmulatorError as exc:
            anthropic = scope["path"].startswith(_MESSAGES)
            await respond(send, exc.status, error_body(exc) if anthropic else exc.body())
        except ClientGone:
            return

    async def _chat(self, receive: Receive, send: Send) -> None:
        adapter, body = self.adapters.adapter_of(parse_body(await read_body(receive)))
        request = parse_chat(body, self.config)
        await until_disconnect(receive, self._generate(request, send, adapter))

    async def _completions(self, receive: Receive, send: Send) -> None:
        adapter, body = self.adapters.adapter_of(parse_body(await read_body(receive)))
        request = parse_completion(body, self.config)
        await until_disconnect(receive, self._generate(request, send, adapter))

    async def _embeddings(self, receive: Receive, send: Send) -> None:
        request = parse_embedding(parse_body(await read_body(receive)), self.config)
        body = embeddings_body(
            self._new_id("embd"),
            int(time.time()),
            self.config.model,
            request.inputs,
            request.base64,
        )
        await respond(send, 200, body)

    async def _tokenize(self, receive: Receive, send: Send) -> None:
        ids = parse_tokenize(parse_body(await read_body(receive)), self.config)
        await respond(send, 200, tokenize_body(ids, self.config.max_model_len))

    async def _detokenize(self, receive: Receive, send: Send) -> None:
        ids = parse_detokenize(parse_body(await read_body(receive)), self.config)
        await respond(send, 200, detokenize_body(decode(ids)))

    def _render(self, parse: Parse, answer: Rendering) -> Handler:
        """A render endpoint: 403 unless scale-out is on, as vLLM's."""

        async def handler(receive: Receive, send: Send) -> None:
            if not self.config.enable_scale_out:
                raise ScaleOutDisabled()
            body = self.adapters.adapter_of(parse_body(await read_body(receive)))[1]
            await respond(send, 200, answer(parse(body, self.config), body, self._new_id))

        return handler

    def _pooled(self, prefix: str, answer: PoolingAnswer) -> Handler:
        async def handler(receive: Receive, send: Send) -> None:
            body = parse_body(await read_body(receive))
            await respond(send, 200, answer(body, self.config, self._new_id(prefix)))

        return handler

    async def _count_tokens(self, receive: Receive, send: Send) -> None:
        body = parse_body(await read_body(receive))
        await respond(send, 200, self.messages.count_tokens(body))

    async def _stored_response(self, method: str, path: str, send: Send) -> None:
        """`GET`/`DELETE /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`."""
        response_id, _, action = path[len(_STORED_RESPONSE) :].partition("/")
        if action == "cancel" and method == "POST":
            body = self.responses.cancel(response_id)
        elif action == "" and method in ("GET", "HEAD"):
            body = self.responses.retrieve(response_id)
        elif action == "" and method == "DELETE":
            body = self.responses.delete(response_id)
        elif action in ("", "cancel"):
            raise MethodNotAllowed("Method Not Allowed")
        else:
            raise NotFound(f"Not Found: {path}")
        await respond(send, 200, body)

    async def _models(self, receive: Receive, send: Send) -> None:
        config = self.config
        body = models_body(config.model, self._created, config.max_model_len, self.adapters.served)
        await respond(send, 200, body)

    async def _load_adapter(self, receive: Receive, send: Send) -> None:
        body = parse_body(await read_body(receive))
        await respond(send, 200, await self.adapters.load(body), b"text/plain; charset=utf-8")

    async def _unload_adapter(self, receive: Receive, send: Send) -> None:
        body = parse_body(await read_body(receive))
        await respond(send, 200, self.adapters.unload(body), b"text/plain; charset=utf-8")

    async def _health(self, receive: Receive, send: Send) -> None:
        await respond(send, 200, b"", b"text/plain; charset=utf-8")

    async def _stall(self, receive: Receive, send: Send) -> None:
        body = parse_body(await read_body(receive))
        self.engine.stall(bool(body.get("stalled", True)))
        await respond(send, 200, b'{"stalled":%s}' % (b"true" if self.engine.stalled else b"false"))

    async def _slow_down(self, receive: Receive, send: Send) -> None:
        factor = parse_body(await read_body(receive)).get("factor")
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not factor > 0:
            raise InvalidRequest("`factor` must be a positive number", param="factor")
        self.engine.slow_down(float(factor))
        await respond(send, 200, b'{"factor":%s}' % str(float(factor)).encode())

    async def _metrics(self, receive: Receive, send: Send) -> None:
        await respond(send, 200, self.metrics.render(), METRICS_CONTENT_TYPE.encode())

    async def _generate(
        self, request: GenerationRequest, send: Send, adapter: str | None = None
    ) -> None:
        prefix = "chatcmpl" if request.kind == "chat" else "cmpl"
        model = adapter or self.config.model
        envelope = Envelope(
            request.kind,
            self._new_id(prefix),
            int(time.time()),
            model,
            self.config.prompt_tokens_details,
        )
        salt = adapter_salt(adapter, request.cache_salt)
        if adapter is not None:
            await self.adapters.activate(adapter)
        if not request.stream:
            results = await _each(
                [self._complete(prompt, limit, salt) for prompt, limit in _choices(request)]
            )
            usage = sum((usage for _, usage in results), Usage())
            await respond(send, 200, envelope.body([text for text, _ in results], usage))
            return
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        usages = await _each(
            [
                self._stream(envelope, index, prompt, limit, salt, send)
                for index, (prompt, limit) in enumerate(_choices(request))
            ]
        )
        tail = DONE
        if request.include_usage:
            tail = envelope.usage_chunk(sum(usages, Usage())) + DONE
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    async def _complete(
        self, prompt: list[int], max_tokens: int, salt: str | None
    ) -> tuple[str, Usage]:
        async with self.engine.run(prompt, max_tokens, salt) as run:
            text = await run.complete()
            return text, Usage(run.prompt_tokens, run.produced, run.cached_tokens)

    async def _stream(
        self,
        envelope: Envelope,
        index: int,
        prompt: list[int],
        max_tokens: int,
        salt: str | None,
        send: Send,
    ) -> Usage:
        async with self.engine.run(prompt, max_tokens, salt) as run:
            last = run.max_tokens - 1
            position = 0
            async for token in run.stream():
                chunk = envelope.chunk(index, token, first=position == 0, last=position == last)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                position += 1
            return Usage(run.prompt_tokens, run.produced, run.cached_tokens)

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}-{self._id_prefix}{next(self._serial):08x}"


def build_app(config: EmulatorConfig) -> EmulatorApp:
    return EmulatorApp(config)


def _created(create: Creation) -> Handler:
    """The handler of an endpoint whose answer is a JSON body or (streamed) its events."""

    async def answer(body: dict[str, Any], send: Send) -> None:
        created = await create(body)
        if isinstance(created, bytes):
            await respond(send, 200, created)
        else:
            await send_events(send, created)

    async def handler(receive: Receive, send: Send) -> None:
        body = parse_body(await read_body(receive))
        await until_disconnect(receive, answer(body, send))

    return handler


def _choices(request: GenerationRequest) -> list[tuple[list[int], int]]:
    return list(zip(request.prompts, request.max_tokens, strict=True))


async def _each(coroutines: Sequence[Coroutine[Any, Any, _T]]) -> list[_T]:
    """Run one coroutine inline, several concurrently (a completions batch)."""
    if len(coroutines) == 1:
        return [await coroutines[0]]
    return list(await asyncio.gather(*coroutines))
