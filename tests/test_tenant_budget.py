"""A budget per minute, on times given to it: taken whole or not at all, refilled evenly over
the minute, settled up or down, and the reset written as OpenAI writes it."""

from __future__ import annotations

import math

from gateway.tenants.budget import MinuteBudget, duration_text


def test_taken_whole_or_not_at_all_and_refilled_evenly() -> None:
    budget = MinuteBudget(600, now=0.0)
    assert budget.take(500, 0.0) == 0.0
    assert budget.remaining(0.0) == 100
    # 200 do not fit: 100 more come in 10 s (600 a minute).
    assert budget.take(200, 0.0) == 10.0
    assert budget.remaining(0.0) == 100  # a refusal takes nothing
    assert budget.take(200, 10.0) == 0.0
    assert budget.remaining(10.0) == 0
    assert budget.reset_seconds(10.0) == 60.0
    assert budget.remaining(70.0) == 600
    assert budget.remaining(1000.0) == 600  # never more than the limit


def test_more_than_the_limit_never_fits() -> None:
    budget = MinuteBudget(600, now=0.0)
    assert math.isinf(budget.take(601, 0.0))


def test_settled_with_the_usage_up_or_down() -> None:
    budget = MinuteBudget(600, now=0.0)
    budget.take(400, 0.0)
    budget.give(300, 0.0)  # charged 400, used 100
    assert budget.remaining(0.0) == 500
    budget.take(500, 0.0)
    budget.give(-120, 0.0)  # charged 500, used 620: the next requests wait for it
    assert budget.remaining(0.0) == 0
    assert budget.take(1, 0.0) == 12.1  # 121 to come back at 10 a second


def test_durations_as_openai_writes_them() -> None:
    assert duration_text(0.02) == "20ms"
    assert duration_text(1.5) == "1.5s"
    assert duration_text(360.0) == "6m0s"
    assert duration_text(59.99) == "59.9s"
