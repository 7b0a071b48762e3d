"""How a request comes in on the proxy path: its id, its body read within its limits, and the
body parsed once into what routing needs (`RoutingInput`), beside the event loop for long
prompts when the engine's tokenizer is used.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import re
import uuid
from concurrent.futures import ThreadPoolExecutor

from prefix_gateway.config import Settings
from prefix_gateway.prompt.parsing import (
    ENDPOINTS,
    BodyLimits,
    RoutingInput,
    parse_request,
    session_hash,
    stored_response_request,
)
from prefix_gateway.prompt.responses_api import response_target
from prefix_gateway.prompt.tokens import EngineTokenizer
from prefix_gateway.proxy.admission import BodyLease
from prefix_gateway.proxy.asgi import Receive, Scope, header, read_body, too_many_pending_bodies
from prefix_gateway.proxy.deadlines import Exchange, Interrupted, Why, client_error
from prefix_gateway.refusals import refused

Headers = list[tuple[bytes, bytes]]

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_TOKENIZED_BESIDE_THE_LOOP = 4096
"""Body bytes from which, with `--tokenizer`, a request is parsed on the tokenizing thread: a
prompt never seen before costs about a millisecond per thousand tokens to encode, which the
event loop would otherwise spend not relaying anything else (the hop costs tens of µs)."""


class RequestIds:
    """Request ids unique across processes and restarts: a random prefix and a counter."""

    def __init__(self) -> None:
        self._prefix = os.urandom(8).hex()
        self._count = itertools.count()

    def next(self) -> str:
        return f"{self._prefix}{next(self._count):016x}"


class Intake:
    def __init__(self, settings: Settings, tokenizer: EngineTokenizer | None) -> None:
        self._settings = settings
        self._tokenizer = tokenizer
        self._ids = RequestIds()
        self.limits = BodyLimits.of(settings)
        self._tokenizing = (
            None
            if tokenizer is None
            else ThreadPoolExecutor(1, thread_name_prefix="gateway-tokenize")
        )

    def stop(self) -> None:
        if self._tokenizing is not None:
            self._tokenizing.shutdown(wait=False, cancel_futures=True)

    def request_id(self, headers: Headers) -> str:
        """The client's `x-request-id` if it is a short token safe to log and forward, else a
        new one."""
        given = header(headers, b"x-request-id")
        if given is not None and _REQUEST_ID.fullmatch(given):
            return given
        return self._ids.next()

    async def body(
        self, headers: Headers, receive: Receive, exchange: Exchange, lease: BodyLease
    ) -> bytes:
        """The whole body within `--body-timeout`, counted in `lease` from its first byte; one
        declared too large is refused unread."""
        settings = self._settings
        declared = header(headers, b"content-length")
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                raise refused("invalid_http", message="invalid content-length") from None
            if length > settings.max_body_bytes:
                raise refused("body_too_large", settings.max_body_bytes)
            if not lease.fits(length):
                raise too_many_pending_bodies()
        exchange.expect(Why.BODY, settings.body_timeout)
        try:
            with exchange.guard():
                body = await read_body(receive, settings.max_body_bytes, lease)
        except Interrupted as stop:
            late = client_error(stop.why, settings.body_timeout)
            if stop.why is not Why.BODY or late is None:
                raise
            raise late from None
        exchange.due = exchange.deadline
        return body

    async def parse(
        self, scope: Scope, body: bytes, tenant: str | None
    ) -> tuple[RoutingInput, str, str | None]:
        """The request as routing sees it, the path it goes to at the replica, and the session
        key minted for it, if one was (`--sticky-cookie`)."""
        path: str = scope["path"]
        target = response_target(path)
        if target is not None:
            query: bytes = scope.get("query_string", b"")
            request = stored_response_request(target[0], query, tenant, body, self.limits)
            return request, path + "?" + query.decode("latin-1") if query else path, None
        headers: Headers = scope["headers"]
        if self._tokenizing is not None and len(body) >= _TOKENIZED_BESIDE_THE_LOOP:
            # The encode releases the GIL: other streams go on while it runs.
            request, issued = await asyncio.get_running_loop().run_in_executor(
                self._tokenizing, self._parsed, path, headers, body, tenant
            )
        else:
            request, issued = self._parsed(path, headers, body, tenant)
        return request, path, issued

    def _parsed(
        self, path: str, headers: Headers, body: bytes, tenant: str | None
    ) -> tuple[RoutingInput, str | None]:
        settings = self._settings
        cookie = settings.sticky_cookie
        session_header = header(headers, b"x-session-id")
        if cookie and session_header is None:
            session_header = _cookie_value(headers, cookie)
        request = parse_request(
            ENDPOINTS[path],
            body,
            session_header,
            settings.default_model,
            settings.session_from_user,
            self.limits,
            tenant,
            self._tokenizer,
        )
        issued = None
        if cookie and request.session_key is None:
            issued = uuid.uuid4().hex
            request = dataclasses.replace(request, session_key=session_hash(issued, tenant))
        return request, issued


def _cookie_value(headers: Headers, name: str) -> str | None:
    """The value of cookie `name` in the request's Cookie headers."""
    for key, value in headers:
        if key == b"cookie":
            for pair in value.decode("latin-1").split(";"):
                cookie, _, content = pair.strip().partition("=")
                if cookie == name and content:
                    return content
    return None
