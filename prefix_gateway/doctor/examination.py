"""The doctor's examination of one replica: every check, in the order they depend on each
other, with HTTP straight to the replica. Nothing goes through the gateway's proxy path, so
the probes leave its prefix index, sessions, cache feedback and request metrics untouched; at
the engine they cost a few short prompts of one generated token each.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from prefix_gateway.backends.backend import Backend
from prefix_gateway.backends.engine_load import missing_engine_series
from prefix_gateway.backends.kv_events import KVEventFeeds
from prefix_gateway.config import Settings
from prefix_gateway.doctor.agreement import token_agreement
from prefix_gateway.doctor.probe import (
    GatewayView,
    chat_body,
    gateway_view,
    new_nonce,
    probe_messages,
)
from prefix_gateway.doctor.verdicts import (
    Check,
    CheckResult,
    failed,
    passed,
    probe_tokens,
    skipped,
)
from prefix_gateway.prompt.tokens import EngineTokenizer

_AIM_ROUNDS = 4
_SALTED_WORDS = 48
_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")


class Unanswered(Exception):
    """The replica did not answer a probe with what was asked for."""


@dataclass(frozen=True)
class Repeat:
    """What the engine said of a probe prompt sent twice."""

    prompt_tokens: int
    cached_tokens: int | None
    """On the repeat; None when its usage carries no `prompt_tokens_details.cached_tokens`."""
    hits_grew: bool | None
    """Whether the engine's prefix-cache hit counter grew over the repeat (read only when it
    does not report cached tokens; None when it exports no such counter)."""


class Doctor:
    """Examines replicas as the gateway configured by `settings` would route to them."""

    def __init__(
        self,
        settings: Settings,
        client: httpx.AsyncClient,
        tokenizer: EngineTokenizer | None,
        feeds: KVEventFeeds | None = None,
        event_wait: float = 10.0,
        probe_seconds: float = 60.0,
    ) -> None:
        """`probe_seconds`: how long one probe prompt may take (a busy engine queues it)."""
        self._settings = settings
        self._timeout = httpx.Timeout(probe_seconds, connect=settings.connect_timeout)
        self._client = client
        self._tokenizer = tokenizer
        self._feeds = feeds
        self._event_wait = event_wait

    async def examine(self, backend: Backend) -> list[CheckResult]:
        results = [await self._reachable(backend)]
        later = [Check.MODELS, Check.LOAD_METRICS, *self._probed_checks()]
        if not results[0].passed:
            return results + [
                skipped(check, "not run: the replica is unreachable") for check in later
            ]
        models, model = await self._models(backend)
        results += [models, await self._load_metrics(backend)]
        probed = self._probed_checks()
        if model is None:
            return results + [skipped(check, "not run: no model to ask") for check in probed]
        try:
            results += await self._probed(backend, model)
        except Unanswered as why:
            results += [failed(check, f"the probe prompt failed: {why}") for check in probed]
        return results

    def _probed_checks(self) -> list[Check]:
        checks = [Check.PREFIX_CACHING, Check.CACHED_TOKENS_REPORTED, Check.TOKEN_AGREEMENT]
        if self._settings.kv_events:
            checks.append(Check.KV_EVENTS)
        if self._settings.isolate_tenants:
            checks.append(Check.CACHE_SALT)
        return checks

    async def _reachable(self, backend: Backend) -> CheckResult:
        try:
            await self._text("GET", backend, "/health")
        except Unanswered as why:
            return failed(Check.REACHABLE, f"{backend.url}: {why}")
        return passed(Check.REACHABLE, "GET /health answered 200")

    async def _models(self, backend: Backend) -> tuple[CheckResult, str | None]:
        try:
            listing = await self._json("GET", backend, "/v1/models")
            listed = sorted(str(item["id"]) for item in listing["data"])
            # A LoRA adapter's blocks are its own (vLLM's KV events carry its id): probe a base.
            bases = sorted(str(item["id"]) for item in listing["data"] if not item.get("parent"))
        except (Unanswered, KeyError, TypeError, AttributeError) as exc:
            return failed(Check.MODELS, f"GET /v1/models: {exc}"), None
        pinned = backend.pinned_model
        if pinned is not None and pinned not in listed:
            why = f"the backend is given as serving {pinned!r}, /v1/models lists {listed}"
            return failed(Check.MODELS, why), None
        if not listed:
            return failed(Check.MODELS, "/v1/models lists no model"), None
        probed = pinned or (bases or listed)[0]
        return passed(Check.MODELS, f"serves {', '.join(listed)}; probed with {probed}"), probed

    async def _load_metrics(self, backend: Backend) -> CheckResult:
        try:
            missing = missing_engine_series(await self._text("GET", backend, "/metrics"))
        except Unanswered as unanswered:
            return failed(Check.LOAD_METRICS, str(unanswered))
        if missing:
            why = f"/metrics lacks {', '.join(missing)}: load and stall detection go without"
            return failed(Check.LOAD_METRICS, why)
        return passed(Check.LOAD_METRICS, "running, waiting, KV-cache usage, generated tokens")

    async def _probed(self, backend: Backend, model: str) -> list[CheckResult]:
        if self._settings.kv_events:
            # An event published before the feed's socket connected is never heard.
            await self._until(lambda: self._feed_live(backend.name))
        messages = await self._aimed(backend, model)
        body = chat_body(model, messages)
        view = gateway_view(self._settings, self._tokenizer, body)
        repeat = await self._repeat(backend, body)
        results = [_prefix_caching(repeat), _cached_tokens_reported(repeat)]
        engine_count = await self._engine_count_of_gateway_text(backend, model, messages, view)
        results.append(
            token_agreement(
                self._settings, view, repeat.prompt_tokens, repeat.cached_tokens, engine_count
            )
        )
        if self._settings.kv_events:
            results.append(await self._kv_events(backend, view))
        if self._settings.isolate_tenants:
            results.append(await self._cache_salt(backend, model))
        return results

    async def _aimed(self, backend: Backend, model: str) -> list[dict[str, str]]:
        """The probe's messages, grown until the engine counts the aimed number of tokens (as
        near as its tokenizer allows); estimated by the gateway where `/tokenize` is missing."""
        nonce = new_nonce()
        target = probe_tokens(self._settings.block_tokens)
        words = target // 2
        best: tuple[int, int] | None = None
        for _ in range(_AIM_ROUNDS):
            messages = probe_messages(nonce, words)
            counted = await self._tokenize(backend, {"model": model, "messages": messages})
            if counted is None:
                view = gateway_view(self._settings, self._tokenizer, chat_body(model, messages))
                counted = round(view.tokens)
            if best is None or abs(counted - target) < abs(best[1] - target):
                best = (words, counted)
            if counted == target:
                break
            per_word = max(1.0, counted / words)
            step = round((target - counted) / per_word) or (1 if target > counted else -1)
            words = max(1, words + step)
        assert best is not None
        return probe_messages(nonce, best[0])

    async def _tokenize(self, backend: Backend, body: dict[str, Any]) -> int | None:
        """The engine's token count for `body` (vLLM's `/tokenize`), or None without one."""
        try:
            counted = await self._json("POST", backend, "/tokenize", body)
            return int(counted["count"])
        except (Unanswered, KeyError, TypeError, ValueError):
            return None

    async def _repeat(self, backend: Backend, body: dict[str, Any]) -> Repeat:
        first = _usage(await self._json("POST", backend, "/v1/chat/completions", body))
        reports = _cached(first) is not None
        hits_before = None if reports else await self._hits(backend)
        again = _usage(await self._json("POST", backend, "/v1/chat/completions", body))
        hits_grew = None
        if hits_before is not None:
            hits_after = await self._hits(backend)
            hits_grew = hits_after is not None and hits_after > hits_before
        return Repeat(int(again["prompt_tokens"]), _cached(again), hits_grew)

    async def _hits(self, backend: Backend) -> float | None:
        try:
            text = await self._text("GET", backend, "/metrics")
        except Unanswered:
            return None
        total = None
        for line in text.splitlines():
            if line.startswith(_HITS):
                total = (total or 0.0) + float(line.rsplit(" ", 1)[-1])
        return total

    async def _engine_count_of_gateway_text(
        self, backend: Backend, model: str, messages: list[dict[str, str]], view: GatewayView
    ) -> int | None:
        """With `--tokenizer`: the engine's count of the gateway's own rendering of the probe,
        which tells a chat template apart from a tokenizer when the counts differ."""
        if self._tokenizer is None or not view.counted:
            return None
        rendered = self._tokenizer.rendered(messages)
        if rendered is None:
            return None
        body = {"model": model, "prompt": rendered, "add_special_tokens": False}
        return await self._tokenize(backend, body)

    async def _kv_events(self, backend: Backend, view: GatewayView) -> CheckResult:
        feeds = self._feeds
        if feeds is None or not view.chain:
            return skipped(Check.KV_EVENTS, "no event feed in this process")

        def told() -> bool:
            blocks = feeds.live().get(backend.name)
            return blocks is not None and view.chain[0] in blocks

        if await self._until(told):
            held = feeds.live()[backend.name].depth(view.chain)
            return passed(Check.KV_EVENTS, f"the feed told of {held} blocks of the probe")
        state = feeds.state(backend.name)
        if state is None:
            why = "no feed: /kv_event_sources names no ZeroMQ publisher (vLLM --kv-events-config)"
        elif not state.connected:
            why = (
                f"no connection to the feed's publisher at {state.endpoint}: is its port"
                " reachable from the gateway?"
            )
        elif not state.live:
            why = f"the feed from {state.endpoint} is not live"
        elif state.messages and state.last_sequence is None:
            why = (
                f"the feed from {state.endpoint} sent {state.messages} messages, none of them"
                " KV-cache events the gateway can read (vLLM's msgpack batches)"
            )
        else:
            why = (
                f"no event for the probe's blocks in {self._event_wait:g} s: the engine's block"
                " size or tokens differ from the gateway's (see token-agreement)"
            )
        return failed(Check.KV_EVENTS, why)

    def _feed_live(self, name: str) -> bool:
        state = self._feeds.state(name) if self._feeds is not None else None
        return state is not None and state.live

    async def _until(self, condition: Callable[[], bool]) -> bool:
        """Whether `condition` holds within `event_wait` seconds (polled)."""
        deadline = time.monotonic() + self._event_wait
        while not condition():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.1)
        return True

    async def _cache_salt(self, backend: Backend, model: str) -> CheckResult:
        nonce = new_nonce()
        messages = probe_messages(nonce, _SALTED_WORDS)
        salted = await self._json(
            "POST", backend, "/v1/chat/completions", chat_body(model, messages, f"a-{nonce}")
        )
        _usage(salted)
        other = chat_body(model, messages, f"b-{nonce}")
        cached = _cached(_usage(await self._json("POST", backend, "/v1/chat/completions", other)))
        if cached is None:
            return skipped(Check.CACHE_SALT, "cannot tell: the engine reports no cached tokens")
        if cached > 0:
            why = (
                f"a repeat under another cache_salt was served {cached} tokens from cache:"
                " tenants' prompts are not isolated in the engine's cache"
            )
            return failed(Check.CACHE_SALT, why)
        return passed(Check.CACHE_SALT, "a repeat under another cache_salt was not a hit")

    async def _json(
        self, method: str, backend: Backend, path: str, body: dict[str, Any] | None = None
    ) -> Any:
        try:
            return orjson.loads(await self._text(method, backend, path, body))
        except orjson.JSONDecodeError as exc:
            raise Unanswered(f"{method} {path} answered no JSON") from exc

    async def _text(
        self, method: str, backend: Backend, path: str, body: dict[str, Any] | None = None
    ) -> str:
        """The replica's 200 answer to `method path`; `Unanswered` for anything else."""
        try:
            answer = await self._client.request(
                method, backend.url + path, json=body, timeout=self._timeout
            )
        except httpx.HTTPError as exc:
            raise Unanswered(f"{method} {path}: {_reason(exc)}") from exc
        if answer.status_code != 200:
            raise Unanswered(f"{method} {path} answered {answer.status_code}: {answer.text[:200]}")
        return answer.text


def _usage(answer: Any) -> dict[str, Any]:
    usage = answer.get("usage") if isinstance(answer, dict) else None
    if not isinstance(usage, dict) or not isinstance(usage.get("prompt_tokens"), int):
        raise Unanswered("the answer carries no usage.prompt_tokens")
    return usage


def _cached(usage: dict[str, Any]) -> int | None:
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) else None


def _prefix_caching(repeat: Repeat) -> CheckResult:
    cached = repeat.cached_tokens
    if cached is None:
        if repeat.hits_grew is None:
            why = "cannot tell: the engine reports no cached tokens and no prefix-cache hits"
            return skipped(Check.PREFIX_CACHING, why)
        if repeat.hits_grew:
            return passed(Check.PREFIX_CACHING, "the repeat counted prefix-cache hits in /metrics")
        return failed(
            Check.PREFIX_CACHING,
            "a repeated prompt counted no prefix-cache hit: is the engine run with prefix"
            " caching (vLLM --enable-prefix-caching)?",
        )
    if cached == 0:
        return failed(
            Check.PREFIX_CACHING,
            f"a repeated prompt of {repeat.prompt_tokens} tokens was served none from cache:"
            " is the engine run with prefix caching (vLLM --enable-prefix-caching)?",
        )
    why = f"a repeated prompt of {repeat.prompt_tokens} tokens was served {cached} from cache"
    return passed(Check.PREFIX_CACHING, why)


def _cached_tokens_reported(repeat: Repeat) -> CheckResult:
    if repeat.cached_tokens is None:
        return failed(
            Check.CACHED_TOKENS_REPORTED,
            "usage.prompt_tokens_details.cached_tokens is missing: cache feedback and the"
            " observed hit rate go without (vLLM --enable-prompt-tokens-details)",
        )
    return passed(Check.CACHED_TOKENS_REPORTED, "usage.prompt_tokens_details.cached_tokens")


def _reason(exc: httpx.HTTPError) -> str:
    if isinstance(exc, httpx.ConnectError):
        return f"cannot connect ({exc})"
    if isinstance(exc, httpx.TimeoutException):
        return "timed out"
    return f"{type(exc).__name__}: {exc}"
