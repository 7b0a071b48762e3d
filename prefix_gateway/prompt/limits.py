"""What a request asks of its answer, read as the engine reads it: the most tokens an answer
may take, and how many answers it asks for (what a tenant's budget reserves ahead)."""

from __future__ import annotations

from typing import Any

_COMPLETION_LIMITS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
"""vLLM obeys `max_completion_tokens` over `max_tokens`: a budget reserves the larger."""
_CHOICES = ("n", "best_of")


def _largest(payload: dict[str, Any], names: tuple[str, ...]) -> int | None:
    """The largest positive count among the fields `names`, read as leniently as the engine
    reads them: `2000`, `2000.0` and `"2000"` alike."""
    largest = None
    for name in names:
        value = payload.get(name)
        if value is not None and (count := _count(value)) is not None:
            largest = count if largest is None else max(largest, count)
    return largest


def _count(value: object) -> int | None:
    """A positive whole number as pydantic's lax mode takes one (vLLM's requests are pydantic
    models): an int, a float without a fraction, or a string of one."""
    if type(value) is int:
        return value if value > 0 else None
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            return None
    if isinstance(value, float):
        if not value.is_integer():
            return None
        value = int(value)
    if isinstance(value, int) and value > 0:
        return value
    return None


def completion_limit(payload: dict[str, Any]) -> int | None:
    """The most tokens each answer may take, if the request says: the largest of its limits."""
    return _largest(payload, _COMPLETION_LIMITS)


def answers_asked(payload: dict[str, Any]) -> int:
    """The answers generated for it: `n`, or `best_of` where larger."""
    return _largest(payload, _CHOICES) or 1
