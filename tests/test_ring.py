from __future__ import annotations

import math
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from prefix_gateway.routing.ring import HashRing, load_bound, within_bound

NAMES = [f"10.0.0.{i}:8000" for i in range(1, 17)]


def test_bound_table() -> None:
    # (total load, backends, factor, floor) -> bound
    cases = [
        ((0, 4, 1.25, 2), 2),  # floor keeps affinity free at low load
        ((15, 4, 1.25, 2), 5),
        ((99, 4, 1.25, 1), 32),
        ((3, 0, 1.25, 2), 2),
    ]
    for args, expected in cases:
        assert load_bound(*args) == expected, args
    assert within_bound(4, 5)
    assert not within_bound(5, 5)


@given(
    st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=16),
    st.floats(min_value=1.0, max_value=3.0),
)
def test_bound_leaves_room_for_one_more(loads: list[int], factor: float) -> None:
    bound = load_bound(sum(loads), len(loads), factor, 1)
    # Someone can always take the request: the least loaded is within the bound.
    assert within_bound(min(loads), bound)


@given(st.integers(min_value=1, max_value=60), st.integers(min_value=2, max_value=12))
@settings(max_examples=60)
def test_placing_requests_never_exceeds_the_bound(requests: int, backends: int) -> None:
    ring = HashRing(NAMES[:backends])
    loads = dict.fromkeys(ring.names, 0)
    for key in range(requests):
        bound = load_bound(sum(loads.values()), backends, 1.25, 1)
        chosen = next(name for name in ring.walk(key * 7919) if within_bound(loads[name], bound))
        loads[chosen] += 1
        assert loads[chosen] <= bound
    assert max(loads.values()) <= max(1, math.ceil(1.25 * requests / backends))


def test_walk_visits_every_backend_once() -> None:
    ring = HashRing(NAMES[:5])
    for key in (0, 1, 2**63, 2**64 - 1):
        assert sorted(ring.walk(key)) == sorted(NAMES[:5])


@given(st.integers(min_value=2, max_value=15))
@settings(max_examples=14, deadline=None)
def test_adding_a_backend_moves_about_its_share(backends: int) -> None:
    before = HashRing(NAMES[:backends])
    after = HashRing(NAMES[: backends + 1])
    keys = range(0, 2**64, 2**64 // 20000)
    moved = sum(1 for key in keys if before.owner(key) != after.owner(key))
    share = moved / len(keys)
    expected = 1 / (backends + 1)
    assert abs(share - expected) < 0.5 * expected
    # Every key that moved went to the new backend: nothing else is disturbed.
    newcomer = NAMES[backends]
    assert all(
        after.owner(key) == newcomer for key in keys if before.owner(key) != after.owner(key)
    )


def test_keys_spread_evenly() -> None:
    ring = HashRing(NAMES[:4])
    owners = Counter(ring.owner(key) for key in range(0, 2**64, 2**64 // 40000))
    assert max(owners.values()) / min(owners.values()) < 1.4


@given(st.integers(min_value=0, max_value=(1 << 64) - 1), st.integers(min_value=1, max_value=16))
@settings(max_examples=100)
def test_distance_orders_backends_as_the_walk_meets_them(key: int, backends: int) -> None:
    ring = HashRing(NAMES[:backends])
    assert sorted(ring.names, key=lambda name: ring.distance(key, name)) == list(ring.walk(key))
    assert ring.distance(key, "not-on-the-ring") > max(ring.distance(key, n) for n in ring.names)
