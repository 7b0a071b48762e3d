"""What a routed request's outcome says of its conversation and its cache: where the turn
went and why it moved, whether the replica that answered is the one before, and the tokens the
replica reported. Counted in metrics; the router calls these once per request."""

from __future__ import annotations

from gateway.backends.pool import ModelPool
from gateway.metrics import Metrics
from gateway.prompt.parsing import Endpoint
from gateway.routing.conversations import (
    AffinityMiss,
    ConversationTracker,
    Turn,
    answer_hash,
    fingerprint,
    miss_cause,
)
from gateway.routing.ring import within_bound
from gateway.routing.routed import Routed
from gateway.routing.types import Decision, Outcome

CONVERSATIONS = frozenset({Endpoint.CHAT, Endpoint.RESPONSES})
"""Endpoints whose prompts are messages, each turn extending the last with its answer."""


def follow_turn(
    conversations: ConversationTracker, metrics: Metrics, routed: Routed
) -> Turn | None:
    """Place the request in its conversation; count a cache break when it has one."""
    request = routed.request
    is_chat = request.endpoint in CONVERSATIONS
    if not is_chat and request.session_key is None:
        return None
    prompt = fingerprint(request.canonical) if is_chat else None
    chosen = routed.backend.name
    turn = conversations.follow(request.session_key, prompt, chosen)
    if turn.cause is not None:
        metrics.child(metrics.cache_breaks, request.model, turn.cause.value).inc()
    previous = turn.previous_backend
    if turn.continues and previous is not None and previous != chosen:
        turn.miss = miss_cause(
            previous,
            routed.serving.loads,
            routed.decision.load_bound,
            routed.state.matched,
            chosen,
        )
    return turn


def settle_turn(metrics: Metrics, routed: Routed, outcome: Outcome, segment: bytes) -> None:
    """Once answered: count failover and affinity, remember who answered and what."""
    model = routed.request.model
    served = outcome.decision.backend
    if len(outcome.tried) > 1:
        metrics.child(metrics.failovers, model).inc()
    turn = routed.turn
    if turn is None:
        return
    turn.record.backend = served
    if segment:
        turn.record.answer = answer_hash(segment)
    if not turn.continues:
        return
    if turn.previous_backend == served:
        metrics.child(metrics.affinity_hits, model).inc()
        return
    miss = turn.miss or AffinityMiss.SPREAD
    if turn.previous_backend in outcome.tried:
        miss = AffinityMiss.FAILOVER
    metrics.child(metrics.affinity_misses, model, miss.value).inc()


def count_reported(metrics: Metrics, outcome: Outcome, model: str) -> None:
    """Count the prompt and cached tokens the replica reported for an answered request."""
    if outcome.status != 200:
        return
    served = outcome.decision.backend
    if outcome.prompt_tokens is not None:
        metrics.child(metrics.upstream_prompt_tokens, model, served).inc(outcome.prompt_tokens)
    if outcome.cached_tokens is not None:
        metrics.child(metrics.upstream_cached_tokens, model, served).inc(outcome.cached_tokens)


def move_cause(sticky: str, serving: ModelPool, decision: Decision) -> str:
    """Why a session left its backend: gone from the candidates, over the bound, or the policy."""
    backend = serving.by_name.get(sticky)
    if backend is None:
        return "unhealthy"
    if decision.load_bound > 0 and not within_bound(backend.load, decision.load_bound):
        return "load_bound"
    return "policy"
