"""A budget per minute, on times given to it: taken whole or not at all, refilled evenly over
the minute, settled up or down, and the reset written as OpenAI writes it."""

from __future__ import annotations

import math

from prefix_gateway.tenants.allowance import Allowance
from prefix_gateway.tenants.budget import MinuteBudget, duration_text


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


def test_a_share_with_a_ceiling_takes_a_charge_above_it_when_whole() -> None:
    # A third of a 600 limit; a charge of 300 is within the limit, not within the share.
    budget = MinuteBudget(200, now=0.0, ceiling=600)
    assert budget.take(300, 0.0) == 0.0  # whole: taken, into debt
    assert budget.remaining(0.0) == 0
    assert budget.take(300, 0.0) == 90.0  # whole again after 300 at 200 a minute
    assert budget.take(300, 90.0) == 0.0
    assert math.isinf(budget.take(601, 200.0))
    assert math.isinf(MinuteBudget(200, now=0.0).take(300, 0.0))  # no ceiling: too large


def test_a_level_reported_and_a_limit_resized() -> None:
    budget = MinuteBudget(600, now=0.0)
    budget.set_level(150, 5.0)
    assert budget.remaining(5.0) == 150
    assert budget.remaining(6.0) == 160  # refilled from when it was reported
    budget.set_level(-60, 6.0)
    assert budget.take(1, 6.0) == 6.1
    budget.set_level(900, 6.0)
    assert budget.remaining(6.0) == 600  # never above the limit
    budget.set_level(300, 6.0)
    budget.resize(200, 6.0)  # half full stays half full
    assert (budget.limit, budget.remaining(6.0)) == (200, 100)
    assert budget.reset_seconds(6.0) == 30.0


def test_an_allowance_shows_the_fleets_figure_when_redis_gave_it() -> None:
    alone = Allowance(600, 0.5, now=0.0)  # --workers 2, no Redis: the share scaled up
    assert alone.take(100, 0.0) == 0.0
    assert (alone.remaining(0.0), alone.shared) == (400, False)
    fleet = Allowance(600, 0.5, now=0.0, fleet_wide=True)
    fleet.seen(240, 0.0)  # Redis answered a charge: the fleet has 240 left
    assert (fleet.remaining(0.0), fleet.shared) == (240, True)
    assert fleet.reset_seconds(0.0) == 36.0
    # Redis away: the share goes on from where the fleet stood (240 of 600: 40%)...
    fleet.reshare(1 / 3, 0.0)
    assert fleet.local.remaining(0.0) == 80
    assert fleet.take(50, 0.0) == 0.0
    assert (fleet.remaining(0.0), fleet.shared) == (90, False)  # 30 of 200, scaled up
    # ...and a charge above the share but within the limit still fits once the share is whole.
    assert fleet.take(300, 0.0) == 51.0
    assert fleet.take(300, 51.0) == 0.0
    assert math.isinf(fleet.take(601, 1000.0))
