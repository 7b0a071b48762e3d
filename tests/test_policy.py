"""The routing policies on tables of cases, asserting the branch that chose."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from gateway.config import POLICY_NAMES, ConfigError, Settings
from gateway.hashing import key_hash
from gateway.policy import POLICIES, Route, RoutingState, build_policy
from gateway.policy.prefix import PrefixPolicy

A, B, C, D = "a:1", "b:1", "c:1", "d:1"
FOUR = (A, B, C, D)
HASHES = list(range(1000, 1040))  # a 40-block prompt


def state(
    loads: dict[str, int] | None = None,
    matched: dict[str, int] | None = None,
    sticky: str | None = None,
    recent: dict[str, float] | None = None,
    candidates: tuple[str, ...] = FOUR,
    key: int = 12345,
) -> RoutingState:
    return RoutingState(
        candidates=candidates,
        loads={name: 0 for name in candidates} | (loads or {}),
        hashes=HASHES,
        matched=matched or {},
        affinity_key=key,
        sticky=sticky,
        recent=recent or {},
    )


policy = PrefixPolicy(load_factor=1.25, load_floor=2, min_match_blocks=4, clear_margin_blocks=4)

CASES = [
    # (description, state, expected backend or None for "any", expected route)
    ("session keeps its backend", state(sticky=C, matched={A: 30}), C, Route.SESSION),
    (
        "session over the bound yields to the prefix",
        state(sticky=C, loads={C: 5}, matched={A: 30}),
        A,
        Route.PREFIX,
    ),
    (
        "sticky backend that is gone is ignored",
        state(sticky="gone:1", matched={B: 20}),
        B,
        Route.PREFIX,
    ),
    ("deepest holder wins", state(matched={A: 10, B: 30}), B, Route.PREFIX),
    ("a match below the minimum is not worth it", state(matched={A: 3}), None, Route.HASH),
    (
        "clear owner keeps its request past the plain bound",
        state(loads={A: 3, B: 1, C: 1, D: 1}, matched={A: 38, B: 4}),
        A,
        Route.PREFIX,
    ),
    (
        "clear owner far over even the loose bound spills",
        state(loads={A: 30, B: 0, C: 0, D: 0}, matched={A: 38}),
        None,
        Route.OVERFLOW,
    ),
    (
        "tie goes to the least loaded holder",
        state(loads={A: 1, B: 0}, matched={A: 10, B: 10}),
        B,
        Route.PREFIX,
    ),
    (
        "tie at equal load goes to the least used recently",
        state(matched={A: 10, B: 10, C: 10}, recent={A: 5.0, B: 1.0, C: 3.0}),
        B,
        Route.PREFIX,
    ),
]


@pytest.mark.parametrize(
    ("description", "given", "backend", "route"), CASES, ids=[case[0] for case in CASES]
)
def test_prefix_policy_table(
    description: str, given: RoutingState, backend: str | None, route: Route
) -> None:
    decision = policy.choose(given)
    assert decision.route is route, description
    if backend is not None:
        assert decision.backend == backend, description
    assert decision.backend in given.candidates


def test_hash_branch_is_stable_and_spreads_keys() -> None:
    chosen = Counter(policy.choose(state(key=key_hash(str(key)))).backend for key in range(4000))
    assert set(chosen) == set(FOUR)
    assert max(chosen.values()) / min(chosen.values()) < 1.5
    assert policy.choose(state(key=99)).backend == policy.choose(state(key=99)).backend


def test_hash_branch_overflows_past_a_full_backend() -> None:
    first = policy.choose(state(key=7)).backend
    spilled = policy.choose(state(key=7, loads={first: 2}))
    assert spilled.route is Route.OVERFLOW
    assert spilled.backend != first


def test_shared_prefix_ties_spread_by_the_block_after_it() -> None:
    # Every backend holds a 10-block system prompt; conversations differ after it.
    chosen = Counter()
    for conversation in range(400):
        hashes = [*range(10), key_hash(f"conversation {conversation}")]
        given = RoutingState(FOUR, dict.fromkeys(FOUR, 0), hashes, dict.fromkeys(FOUR, 10), 0)
        chosen[policy.choose(given).backend] += 1
    assert set(chosen) == set(FOUR)
    assert max(chosen.values()) < 2 * min(chosen.values())


def test_hot_prefix_spreads_only_as_load_requires() -> None:
    # One hot prefix of 20 blocks, held first by A alone, each request with its own 20-block
    # question; requests arrive while earlier ones still run.
    loads = dict.fromkeys(FOUR, 0)
    matched = {A: 20}
    for _ in range(8):
        decision = policy.choose(state(loads=loads, matched=matched))
        loads[decision.backend] += 1
        matched[decision.backend] = 20  # the chosen backend now holds the prefix too
        # A sole holder may go past the plain bound by the share only it holds (half here).
        assert loads[decision.backend] <= math.ceil(decision.load_bound * (1 + 0.5 * 1.5))
    used = [name for name in FOUR if loads[name]]
    assert len(used) < 4  # 8 in flight fit on fewer replicas than all
    assert max(loads.values()) <= 4


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_answers_with_a_candidate(name: str) -> None:
    chosen = build_policy(Settings(backend=("x",), policy=name), random.Random(1))
    for key in range(50):
        decision = chosen.choose(state(key=key, matched={A: 5}))
        assert decision.backend in FOUR


def test_round_robin_cycles() -> None:
    chosen = build_policy(Settings(backend=("x",), policy="round_robin"))
    assert [chosen.choose(state()).backend for _ in range(8)] == [*FOUR, *FOUR]


def test_registry_matches_the_documented_names() -> None:
    assert set(POLICIES) == set(POLICY_NAMES)


def test_unknown_policy_is_a_start_up_error() -> None:
    with pytest.raises(ConfigError):
        Settings(backend=("x",), policy="fastest").validate()
