"""Every routing and request metric, counted once: when a placement is made (`placed`) and
when its outcome is settled (`settled`). Reads placements and outcomes; writes nothing else.
"""

from __future__ import annotations

from prefix_gateway.backends.backend import ModelPool
from prefix_gateway.config import Settings
from prefix_gateway.metrics import Metrics
from prefix_gateway.routing.conversations import AffinityMiss
from prefix_gateway.routing.placement import Placement
from prefix_gateway.routing.ring import within_bound
from prefix_gateway.routing.types import Decision, Outcome, Route


class RoutingObserver:
    def __init__(self, metrics: Metrics, settings: Settings) -> None:
        self._metrics = metrics
        self._decision_seconds = metrics.decision_seconds.labels(settings.policy)
        self._block_tokens = settings.block_tokens
        self._chars_per_token = settings.chars_per_token

    def placed(self, placement: Placement, seconds: float) -> None:
        self._decision_seconds.observe(seconds)
        if placement.pinned:
            return
        metrics = self._metrics
        model = placement.request.model
        sticky, decision = placement.sticky, placement.decision
        if sticky is not None and sticky != decision.backend:
            metrics.session_moves.labels(_move_cause(sticky, placement.serving, decision)).inc()
        if decision.route is Route.OVERFLOW:
            metrics.child(metrics.overflows, model).inc()
        turn = placement.turn
        if turn is not None and turn.cause is not None:
            metrics.child(metrics.cache_breaks, model, turn.cause.value).inc()

    def settled(self, placement: Placement, outcome: Outcome) -> None:
        metrics = self._metrics
        request = placement.request
        model = request.model
        decision = outcome.decision
        served = decision.backend
        status = outcome.status
        metrics.child(metrics.requests, model, served, decision.route.value, str(status)).inc()
        if len(outcome.tried) > 1:
            metrics.child(metrics.failovers, model).inc()
            if request.session_key is not None and served != placement.backend.name:
                metrics.session_moves.labels("failover").inc()
        if status != 200:
            return
        predicted = decision.predicted_seconds
        if predicted is not None:
            observed = placement.first_token_seconds(outcome)
            if observed is not None:
                metrics.child(metrics.first_token.predictions, served).inc()
                metrics.child(metrics.first_token.predicted_seconds, served).inc(predicted)
                metrics.child(metrics.first_token.observed_seconds, served).inc(observed)
        if outcome.prompt_tokens is not None:
            metrics.child(metrics.upstream_prompt_tokens, model, served).inc(outcome.prompt_tokens)
        if outcome.cached_tokens is not None:
            metrics.child(metrics.upstream_cached_tokens, model, served).inc(outcome.cached_tokens)
        if placement.pinned or not request.endpoint.by_prefix:
            return
        metrics.child(metrics.prompt_tokens_estimated, model).inc(
            request.estimated_tokens(self._chars_per_token)
        )
        metrics.child(metrics.matched_tokens_predicted, model).inc(
            decision.matched_blocks * self._block_tokens
        )
        turn = placement.turn
        if turn is None or not turn.continues:
            return
        if turn.previous_backend == served:
            metrics.child(metrics.affinity_hits, model).inc()
            return
        miss = turn.miss or AffinityMiss.SPREAD
        if turn.previous_backend in outcome.tried:
            miss = AffinityMiss.FAILOVER
        metrics.child(metrics.affinity_misses, model, miss.value).inc()


def _move_cause(sticky: str, serving: ModelPool, decision: Decision) -> str:
    """Why a session left its backend: gone from the candidates, over the bound, or the policy."""
    backend = serving.by_name.get(sticky)
    if backend is None:
        return "unhealthy"
    if decision.load_bound > 0 and not within_bound(backend.load, decision.load_bound):
        return "load_bound"
    return "policy"
