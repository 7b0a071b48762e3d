"""What a request costs in tokens: ahead of its answer, and once the engine reported its usage.
The budgets and the fair queue count alike."""

from __future__ import annotations

from prefix_gateway.prompt.parsing import RoutingInput


def estimated_cost(request: RoutingInput, chars_per_token: float, completion_default: int) -> float:
    """Its prompt tokens (counted with the engine's tokenizer, else estimated) plus the most its
    answer may take: its `max_tokens`, or `completion_default` when it sets none."""
    estimate = request.estimated_tokens(chars_per_token)
    if request.endpoint.generates:
        estimate += request.max_tokens or completion_default
    return estimate


def used_cost(prompt: int, cached: int, completion: int, cached_cost: float) -> float:
    """Tokens as used: the prompt not cached, cached prompt tokens at `cached_cost` (the cache
    made them cheap), and the completion."""
    return prompt - cached + cached * cached_cost + completion
