"""`POST /admin/explain`: where the gateway would send a request and why, without forwarding or
recording it (docs/observability.md).
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from prefix_gateway.components import Components
from prefix_gateway.control.access import AdminRoute, Guard
from prefix_gateway.errors import BadRequest
from prefix_gateway.prompt.parsing import ENDPOINTS, BodyLimits, Endpoint, parse_request
from prefix_gateway.routing.placement import Placement
from prefix_gateway.routing.policies import Route
from prefix_gateway.routing.router import Explanation
from prefix_gateway.routing.types import RoutingState

_REASONS = {
    Route.SESSION: "the session key's backend {backend} is a candidate within the load bound",
    Route.OWNER: (
        "{backend} holds clearly more of the prompt than any other backend ({matched} tokens "
        "matched) and is within the looser bound that share earns it; a shared system prompt "
        "stays only while it is cold and {backend} not busy with recent requests"
    ),
    Route.PREFIX: (
        "{backend} holds the deepest prefix match worth routing on ({matched} tokens) among "
        "the backends within the load bound and not running hot; equal depths go to the least "
        "pending prefill, then the least load, then the fewest recent requests, then the ring"
    ),
    Route.OVERFLOW: (
        "where the request belongs is full: for policy prefix, every backend holding its "
        "prefix is at the load bound or running hot, and {backend} is the first by pending "
        "prefill, load and recent requests of the first backends within both on the ring from "
        "the block after the match; for consistent_hash, {backend} is the next backend within "
        "the load bound on the ring from the affinity key ({matched} tokens matched there)"
    ),
    Route.HASH: (
        "no prefix match worth routing on (below {min_match} tokens): {backend} comes from "
        "the ring on the affinity key; for policy prefix, the first by pending prefill, load "
        "and recent requests of the first backends within the load bound and not running hot "
        "there, for consistent_hash the key's own backend"
    ),
    Route.ADAPTER: (
        "the model is a LoRA adapter and no prefix match is worth routing on: {backend} is the"
        " first backend within the load bound on the ring from the adapter's name, so that the"
        " adapter stays on as few replicas as its load needs"
    ),
    Route.FALLBACK: (
        "no backend may take the request by the other rules (for policy prefix: every backend "
        "within the load bound is running hot): {backend} is the first within the load bound "
        "on the ring from the request's key, or the least loaded if none is"
    ),
    Route.RETRY: "{backend} is the next candidate after a failed attempt",
    Route.LEAST_LOADED: (
        "policy least_loaded, or an endpoint placement by model alone: {backend} has the fewest"
        " requests in flight"
    ),
    Route.PREVIOUS_RESPONSE: (
        "{backend} stored the response the request names in previous_response_id: only it can"
        " answer"
    ),
    Route.FASTER: (
        "{backend} is predicted to give the first token sooner than the rule's choice, by more "
        "than the margin, counting the prefill its match ({matched} tokens) saves and the "
        "work ahead of it, within the load bound (see candidates' predicted_ttft_ms)"
    ),
    Route.ROUND_ROBIN: "policy round_robin: {backend} is next in turn",
    Route.RANDOM: "policy random: {backend} was drawn",
}


def build_explain_router(components: Components, guard: Guard) -> APIRouter:
    settings = components.settings
    router = APIRouter(
        prefix="/admin", tags=["admin"], route_class=AdminRoute, dependencies=[Depends(guard)]
    )

    @router.post("/explain")
    async def explain(request: Request, endpoint: str | None = None) -> Response:
        """Where this request would go and why, without sending or recording it."""
        body = await request.body()  # bounded before it was read: control/bodies.py
        parsed = parse_request(
            _endpoint(endpoint, body, "anthropic-version" in request.headers),
            body,
            request.headers.get("x-session-id"),
            settings.default_model,
            settings.session_from_user,
            BodyLimits.of(settings),
            tokenizer=components.router.tokenizer,
        )
        explanation = await components.router.explain(parsed)
        return Response(
            orjson.dumps(_render(explanation, components)), media_type="application/json"
        )

    return router


def _endpoint(given: str | None, body: bytes, anthropic: bool) -> Endpoint:
    """The endpoint named, else the one the body is for (Anthropic's clients send their
    version header; only a Messages body has a `system` field beside `messages`)."""
    if given is not None:
        found = ENDPOINTS.get(given)
        if found is None:
            raise BadRequest(
                f"endpoint must be one of {', '.join(ENDPOINTS)}",
                param="endpoint",
                code="invalid_endpoint",
            )
        return found
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from exc
    if isinstance(payload, dict):
        if "messages" in payload and (anthropic or "system" in payload):
            return Endpoint.MESSAGES
        for field, endpoint in (
            ("messages", Endpoint.CHAT),
            ("prompt", Endpoint.COMPLETIONS),
            # Only the Responses API has these beside `input`.
            ("instructions", Endpoint.RESPONSES),
            ("previous_response_id", Endpoint.RESPONSES),
            ("input", Endpoint.EMBEDDINGS),
        ):
            if field in payload:
                return endpoint
    raise BadRequest(
        "cannot tell the endpoint from the body: give ?endpoint=/v1/chat/completions",
        param="endpoint",
        code="invalid_endpoint",
    )


def _render(explained: Explanation, components: Components) -> dict[str, Any]:
    settings = components.settings
    block_tokens = settings.block_tokens
    placement = explained.placement
    request = placement.request
    decision = placement.decision
    state = placement.state
    bound = decision.load_bound
    backends = []
    for backend in components.pool.backends:
        if request.model not in backend.models:
            continue
        candidate = backend.name in state.loads
        matched = state.matched.get(backend.name, 0)
        backends.append(
            {
                "backend": backend.name,
                "candidate": candidate,
                "healthy": backend.healthy,
                "in_flight": backend.in_flight,
                "queued": backend.queued,
                "load": backend.load,
                "pending_prefill_blocks": backend.pending_prefill,
                "fleet_pending_prefill_blocks": backend.fleet_pending_prefill,
                "within_bound": candidate and (not bound or backend.load + 1 <= bound),
                "matched_blocks": matched,
                "matched_tokens": matched * block_tokens,
                "recent_requests": round(state.recent.get(backend.name, 0.0), 3),
                **_first_token(state, backend.name, block_tokens),
            }
        )
    turn = explained.turn
    reason = _REASONS[decision.route].format(
        backend=decision.backend,
        matched=decision.matched_blocks * block_tokens,
        min_match=settings.min_match_tokens,
    )
    return {
        "model": request.model,
        "endpoint": request.endpoint.value,
        "policy": settings.policy,
        "backend": decision.backend,
        "route": decision.route.value,
        "reason": reason,
        "matched_tokens": decision.matched_blocks * block_tokens,
        "predicted_ttft_ms": (
            None
            if decision.predicted_seconds is None
            else round(decision.predicted_seconds * 1000, 1)
        ),
        "prompt_tokens_estimated": round(request.estimated_tokens(settings.chars_per_token)),
        "prompt_blocks": len(placement.chain),
        "block_tokens": block_tokens,
        "load_bound": bound,
        "load_factor": settings.load_factor,
        "affinity_key": f"{placement.state.affinity_key:016x}",
        "session_key": request.session_key,
        "sticky_backend": placement.sticky,
        "conversation": {
            "continuity": turn.continuity.value,
            "previous_backend": turn.previous_backend,
            "cache_break": turn.cause.value if turn.cause is not None else None,
        },
        "inputs": _inputs(placement, components),
        "candidates": backends,
    }


def _first_token(state: RoutingState, name: str, block_tokens: int) -> dict[str, Any]:
    """What the learned time to first token predicts at `name` for this request: the work it
    would compute there (its prompt less its match, and the pending prefill ahead of it) and
    the seconds that takes by the replica's line (null: nothing learned, or not predicting)."""
    times = state.first_token
    if times is None:
        return {}
    uncached = max(0, state.prompt_tokens - state.matched.get(name, 0) * block_tokens)
    work = state.pending_prefill.get(name, 0) * block_tokens + uncached
    seconds = times.seconds(name, work)
    return {
        "ttft_work_tokens": work,
        "predicted_ttft_ms": None if seconds is None else round(seconds * 1000, 1),
    }


# A fleet exchange older than this no longer counts (the others' counts were dropped).
_EXCHANGE_FRESH_SECONDS = 1.0


def _inputs(placement: Placement, components: Components) -> dict[str, Any]:
    """Which of the policy's inputs came from the fleet (through Redis) and which were this
    gateway's own, for this decision."""
    link, exchange = components.redis, components.shared_load
    redis_up = link is not None and link.up
    exchanged_ago = time.monotonic() - exchange.exchanged_at if exchange is not None else None
    exchanged = exchanged_ago is not None and exchanged_ago < _EXCHANGE_FRESH_SECONDS
    fleet = placement.fleet
    traffic = components.router.memory.traffic
    has_prompt = traffic.shared_prompt(placement.chain, placement.state.private_from)

    def source(shared: bool) -> str:
        return "fleet" if shared else "local"

    return {
        "matched_blocks": source(redis_up),
        "sticky_backend": source(redis_up) if placement.request.session_key is not None else None,
        "load": "local + fleet" if exchanged else "local",
        "pending_prefill": "local + fleet" if exchanged else "local",
        "recent_requests": "local + fleet" if exchanged else "local",
        "prompt_share": (
            None
            if has_prompt is None
            else source(fleet is not None and fleet.prompt_count is not None)
        ),
        "claim": source(fleet is not None) if fleet is not None else None,
        "claimed_backend": fleet.claimed if fleet is not None else None,
        "fleet_exchange_ms_ago": (
            round(exchanged_ago * 1000) if exchanged_ago is not None and exchanged else None
        ),
    }
