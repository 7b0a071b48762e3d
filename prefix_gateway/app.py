"""The ASGI application: the lean proxy path for inference, FastAPI for everything else, with
client keys and the shutting-down `/ready` in front of both. The inference routes are declared
on FastAPI only so that `/openapi.json` describes them. With `--metrics-port`, a request is
first told apart by the port it came in on: that port serves `/metrics` alone, and the API's
port serves everything else.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from fastapi import FastAPI, Path
from pydantic import BaseModel, ConfigDict, Field

from prefix_gateway.auth import KEY_POSITION, PROTECTED_PREFIX, TENANT, ApiKeys, tenant_of
from prefix_gateway.backends.pool import BackendPool
from prefix_gateway.collector import settle_after_start
from prefix_gateway.components import Components
from prefix_gateway.config import Settings
from prefix_gateway.control.app import build_control_app
from prefix_gateway.errors import GatewayError, error_shape
from prefix_gateway.prompt.parsing import ENDPOINTS, Endpoint
from prefix_gateway.prompt.responses_api import RESPONSE_ID, response_target
from prefix_gateway.proxy.asgi import ASGIApp, Receive, Scope, Send, send_error, send_json
from prefix_gateway.proxy.upstream import passed_through
from prefix_gateway.refusals import count_refusal, refused

log = logging.getLogger("prefix_gateway.app")


class GatewayApp:
    def __init__(self, settings: Settings, pool: BackendPool | None = None) -> None:
        self.settings = settings
        self._pool = pool
        self.components: Components | None = None
        self._control: ASGIApp | None = None
        self._api_keys = ApiKeys((*settings.api_key, *(t.api_key for t in settings.tenants)))
        self._isolate_tenants = settings.isolate_tenants
        self._metrics_port = settings.metrics_port
        self.shutting_down = False

    def begin_shutdown(self) -> None:
        """From now on `/ready` says no; requests are still served until the listener closes."""
        if not self.shutting_down:
            self.shutting_down = True
            log.warning("shutting down: /ready now answers 503")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            assert self.components is not None and self._control is not None
            path = scope["path"]
            if self._metrics_port:
                on_metrics_port = _local_port(scope) == self._metrics_port
                if on_metrics_port != (path == "/metrics"):
                    # Not counted as a rejection: neither is a request of the proxy path.
                    code = "metrics_port_only" if on_metrics_port else "metrics_elsewhere"
                    await send_error(send, refused(code))
                    return
                if on_metrics_port:
                    await self._control(scope, receive, send)
                    return
            # The engines' endpoints outside /v1/ (`/tokenize`...) need a client key too.
            if self._api_keys and (path.startswith(PROTECTED_PREFIX) or path in ENDPOINTS):
                try:
                    key, scope[KEY_POSITION] = self._api_keys.check(scope["headers"])
                except GatewayError as unknown_key:
                    await self._refuse(unknown_key, send, path)
                    return
                if self._isolate_tenants:
                    scope[TENANT] = tenant_of(key)
            allowed = _proxied_methods(path)
            if allowed is not None:
                if passed_through(scope["headers"]):
                    await self._refuse(refused("loop_detected"), send, path)
                elif scope["method"] in allowed:
                    await self.components.proxy(scope, receive, send)
                else:
                    allow = ((b"allow", ", ".join(allowed).encode()),)
                    wrong = refused("http_405", " or ".join(allowed), path, headers=allow)
                    await self._refuse(wrong, send, path)
            elif path == "/ready" and self.shutting_down:
                body = orjson.dumps({"ready": False, "shutting_down": True})
                await send_json(send, 503, body)
            else:
                await self._control(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _refuse(self, error: GatewayError, send: Send, path: str) -> None:
        assert self.components is not None
        count_refusal(self.components.metrics, error)
        await send_error(send, error, shape=error_shape(path))

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    self.components = Components.build(self.settings, self._pool)
                    await self.components.start()
                    control = build_control_app(self.components)
                    _declare_inference_routes(control)
                    self._control = control
                    settle_after_start()
                except Exception as exc:
                    log.exception("start-up failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.components is not None:
                    await self.components.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return


_ID_PATTERN = f"^{RESPONSE_ID.pattern}$"


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ChatMessage(_Open):
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Open):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool | None = None
    max_tokens: int | None = Field(default=None, ge=1)


class CompletionRequest(_Open):
    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    stream: bool | None = None
    max_tokens: int | None = Field(default=None, ge=1)


class EmbeddingRequest(_Open):
    model: str
    input: str | list[str] | list[int] | list[list[int]]


class ResponseRequest(_Open):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = Field(default=None, pattern=_ID_PATTERN)
    stream: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)


class MessagesRequest(_Open):
    """Anthropic's Messages API."""

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    stream: bool | None = None


class ModelRequest(_Open):
    """A body routed by its model alone (`/tokenize`, `/v1/rerank`...)."""

    model: str


def _declare_inference_routes(app: FastAPI) -> None:
    """Describe the proxy path's routes in the OpenAPI schema (they are served elsewhere)."""

    async def chat(body: ChatCompletionRequest) -> dict[str, Any]:
        raise NotImplementedError

    async def completions(body: CompletionRequest) -> dict[str, Any]:
        raise NotImplementedError

    async def embeddings(body: EmbeddingRequest) -> dict[str, Any]:
        raise NotImplementedError

    async def responses(body: ResponseRequest) -> dict[str, Any]:
        raise NotImplementedError

    async def stored(response_id: str = Path(pattern=_ID_PATTERN)) -> dict[str, Any]:
        raise NotImplementedError

    async def messages(body: MessagesRequest) -> dict[str, Any]:
        raise NotImplementedError

    async def by_model(body: ModelRequest) -> dict[str, Any]:
        raise NotImplementedError

    for path, endpoint, summary in (
        ("/v1/chat/completions", chat, "Chat completion (OpenAI), routed to a replica"),
        ("/v1/completions", completions, "Text completion (OpenAI), routed to a replica"),
        ("/v1/embeddings", embeddings, "Embeddings (OpenAI), routed to a replica"),
        ("/v1/responses", responses, "Response (OpenAI Responses API), routed to a replica"),
        ("/v1/responses/{response_id}/cancel", stored, "Cancel, at the replica that stored it"),
        ("/v1/messages", messages, "Message (Anthropic Messages API), routed to a replica"),
    ):
        app.add_api_route(path, endpoint, methods=["POST"], summary=summary, tags=["inference"])
    app.add_api_route(
        "/v1/responses/{response_id}",
        stored,
        methods=["GET", "DELETE"],
        summary="A stored response, at the replica that stored it",
        tags=["inference"],
    )
    for engine_endpoint in Endpoint:
        if not engine_endpoint.by_prefix:
            path = engine_endpoint.value
            summary = f"{path} (vLLM), routed by model to the least loaded replica"
            app.add_api_route(path, by_model, methods=["POST"], summary=summary, tags=["engine"])
    app.openapi_schema = None


_POST = ("POST",)
_STORED_RESPONSE = ("GET", "DELETE")


def _local_port(scope: Scope) -> int | None:
    """The port of the listener whose connection carries the request: `server` is the
    connection's own local address, whatever the client's headers say."""
    server = scope.get("server")
    return server[1] if server else None


def _proxied_methods(path: str) -> tuple[str, ...] | None:
    """The methods the proxy path takes at `path`, or None when it is the control plane's."""
    if path in ENDPOINTS:
        return _POST
    target = response_target(path)
    if target is None:
        return None
    return _POST if target[1] else _STORED_RESPONSE
