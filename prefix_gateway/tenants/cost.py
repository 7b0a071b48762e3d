"""What a request costs in tokens: reserved when it is admitted, charged once it ended. The
budgets and the fair queue count alike (docs/tenants.md, "What a request is charged").

A request reserves its prompt's tokens plus the most its answers may take: the largest of
its `max_tokens`, `max_completion_tokens` and `max_output_tokens`, times its `n` (or
`best_of`); when it sets none, what the model's context leaves after the prompt (the engine's
own default), or `--budget-max-tokens` where the replicas do not say their context length.

It is charged as the vendors bill: what the engine reported it used. An answer that broke off
before its usage came is charged its prompt and the tokens relayed to the client; one the
client never received a byte of (refused, failed, or cut before its first byte) costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefix_gateway.prompt.parsing import RoutingInput
from prefix_gateway.routing.types import Outcome


@dataclass(slots=True)
class Usage:
    prompt: int = 0
    cached: int = 0
    completion: int = 0


def tokens_reserved(
    request: RoutingInput,
    chars_per_token: float,
    context_length: int | None,
    completion_default: int,
) -> float:
    """The tokens `request` reserves: its prompt's (counted with the engine's tokenizer, else
    estimated) and the most its answers may take."""
    prompt = request.estimated_tokens(chars_per_token)
    if not request.endpoint.generates or request.response_id is not None:
        return prompt  # a stored response's reading, deletion or cancelling generates nothing
    completion = request.max_tokens
    if completion is None:
        completion = (
            max(1, context_length - round(prompt))
            if context_length is not None
            else completion_default
        )
    return prompt + completion * request.choices


def usage_of(
    outcome: Outcome | None, streamed: bool, reserved: float, prompt_estimate: float
) -> Usage | None:
    """What a request that ended with `outcome` (None: before any replica was asked) used:
    the engine's figures where it reported them, else its prompt as estimated and, for the
    answer, the tokens relayed (a stream) or the reservation's (a whole body); None when the
    client never received a byte of an answer (nothing is charged)."""
    if outcome is None or not outcome.answered:
        return None
    prompt = outcome.prompt_tokens
    completion = outcome.completion_tokens
    if completion is None:
        completion = outcome.relayed_tokens
        if not streamed:
            completion = max(completion, round(reserved - prompt_estimate))
    return Usage(
        round(prompt_estimate) if prompt is None else prompt,
        outcome.cached_tokens or 0,
        completion,
    )


def used_cost(usage: Usage, cached_cost: float) -> float:
    """Tokens as used: the prompt not cached, cached prompt tokens at `cached_cost` (the cache
    made them cheap), and the completion."""
    return usage.prompt - usage.cached + usage.cached * cached_cost + usage.completion
