"""The routing policies on tables of cases, asserting the branch that chose."""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefix_gateway.backends.backend import Backend
from prefix_gateway.backends.pool import BackendPool
from prefix_gateway.clock import ManualClock
from prefix_gateway.config import ConfigError, Settings
from prefix_gateway.prompt.hashing import key_hash
from prefix_gateway.routing.policies import POLICIES, Route, RoutingState, build_policy
from prefix_gateway.routing.prefix_policy import Allowance, PrefixPolicy, eligible
from prefix_gateway.routing.ring import HashRing, load_bound
from prefix_gateway.routing.traffic import RecentTraffic, Traffic

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


SETTINGS = Settings()  # load factor 1.25, floor 2, minimum match 4 blocks, owner margin 4
policy = PrefixPolicy(SETTINGS)
RING = HashRing(FOUR)
BUSY = {A: 3, B: 3, C: 3, D: 3}  # 12 in flight: bound ceil(1.25 * 13 / 4) = 5, under load


def first_clockwise(key: int, names: tuple[str, ...]) -> str:
    return min(names, key=lambda name: RING.distance(key, name))


# (description, state, expected backend or None for "any", expected route)
RULES = [
    ("session keeps its backend", state(sticky=C, matched={A: 30}), C, Route.SESSION),
    (
        "session over the bound yields to the next rules",
        state(sticky=C, loads={C: 5}, matched={A: 30}),
        A,
        Route.OWNER,
    ),
    (
        "sticky backend that is gone is ignored",
        state(sticky="gone:1", matched={B: 20}),
        B,
        Route.OWNER,
    ),
    (
        "clear owner keeps its request past the plain bound",
        state(loads={A: 3, B: 1, C: 1, D: 1}, matched={A: 38, B: 4}),
        A,
        Route.OWNER,
    ),
    (
        "clear owner far over even the looser bound spills",
        state(loads={A: 30, B: 0, C: 0, D: 0}, matched={A: 38}),
        None,
        Route.OVERFLOW,
    ),
    ("deepest holder wins without a clear owner", state(matched={A: 10, B: 12}), B, Route.PREFIX),
    (
        "holders all at the bound: the ring past the match",
        state(loads={A: 5, B: 5}, matched={A: 10, B: 10}),
        None,
        Route.OVERFLOW,
    ),
    ("a match below the minimum is not worth it", state(matched={A: 3}), None, Route.HASH),
    ("no match: the ring on the affinity key", state(), None, Route.HASH),
    (
        "every backend within the bound runs hot",
        state(loads={A: 3, B: 3}, recent={C: 20.0, D: 20.0}),
        None,
        Route.FALLBACK,
    ),
]

# One case per step of the tie-break order, among holders of the same 10 blocks.
TIED = {A: 10, B: 10, C: 10}
TIE_BREAKS = [
    (
        "least pending prefill first, before load",
        dataclasses.replace(
            state(loads=BUSY | {A: 4}, matched=TIED), pending_prefill={B: 40, C: 8}
        ),
        A,
    ),
    ("then the least load", state(loads=BUSY | {B: 2}, matched=TIED), B),
    (
        "loads the floor admits anyway compare equal",
        state(loads={A: 1, B: 0, C: 1}, matched=TIED, recent={A: 1.0, B: 4.0, C: 3.0}),
        A,
    ),
    ("then the fewest recent requests", state(matched=TIED, recent={A: 5.0, B: 1.0, C: 3.0}), B),
    (
        "then clockwise from the block after the tied depth",
        state(matched=TIED),
        first_clockwise(HASHES[10], (A, B, C)),
    ),
]


@pytest.mark.parametrize(
    ("description", "given", "backend", "route"), RULES, ids=[case[0] for case in RULES]
)
def test_each_rule_has_its_route(
    description: str, given: RoutingState, backend: str | None, route: Route
) -> None:
    decision = policy.choose(given)
    assert decision.route is route, description
    if backend is not None:
        assert decision.backend == backend, description
    assert decision.backend in given.candidates


@pytest.mark.parametrize(
    ("description", "given", "backend"), TIE_BREAKS, ids=[case[0] for case in TIE_BREAKS]
)
def test_ties_follow_one_order(description: str, given: RoutingState, backend: str) -> None:
    decision = policy.choose(given)
    assert (decision.backend, decision.route) == (backend, Route.PREFIX), description


def test_hash_branch_is_stable_and_spreads_keys() -> None:
    chosen = Counter(policy.choose(state(key=key_hash(str(key)))).backend for key in range(4000))
    assert set(chosen) == set(FOUR)
    assert max(chosen.values()) / min(chosen.values()) < 1.5
    assert policy.choose(state(key=99)).backend == policy.choose(state(key=99)).backend


def test_the_hash_rule_passes_over_a_full_backend() -> None:
    first = policy.choose(state(key=7)).backend
    spilled = policy.choose(state(key=7, loads={first: 2}))
    assert spilled.route is Route.HASH
    assert spilled.backend != first


def test_shared_prefix_ties_spread_by_the_block_after_it() -> None:
    # Every backend holds a 10-block system prompt; conversations differ after it.
    chosen: Counter[str] = Counter()
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


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_policy_answers_with_a_candidate(name: str) -> None:
    chosen = build_policy(Settings(backend=("x:1",), policy=name), random.Random(1))
    for key in range(50):
        decision = chosen.choose(state(key=key, matched={A: 5}))
        assert decision.backend in FOUR


def test_round_robin_cycles() -> None:
    chosen = build_policy(Settings(backend=("x:1",), policy="round_robin"))
    turns = [dataclasses.replace(state(), sequence=number) for number in range(8)]
    assert [chosen.choose(turn).backend for turn in turns] == [*FOUR, *FOUR]


def test_registry_matches_the_documented_names() -> None:
    assert list(POLICIES) == ["prefix", "consistent_hash", "least_loaded", "round_robin", "random"]


def test_unknown_policy_is_a_start_up_error() -> None:
    with pytest.raises(ConfigError, match="prefix, consistent_hash"):
        build_policy(Settings(backend=("x:1",), policy="fastest").validate())


def shared_prompt_state(
    traffic: Traffic, loads: dict[str, int], matched: dict[str, int], prompt: int, key: int = 1
) -> RoutingState:
    """A 40-block request whose first 36 blocks are a system prompt numbered `prompt`,
    counted in `traffic`."""
    hashes = [prompt * 1000 + depth for depth in range(40)]
    return RoutingState(
        candidates=FOUR,
        loads=loads,
        hashes=hashes,
        matched=matched,
        affinity_key=key,
        private_from=36,
        shared_share=traffic.prompt_share(hashes, 36, count=True),
    )


def test_a_cold_shared_prompt_stays_with_its_only_holder_past_the_plain_bound() -> None:
    # One customer's system prompt among many: a small share of the traffic, held by A alone.
    traffic = Traffic(ManualClock(), SETTINGS)
    for other in range(40):
        shared_prompt_state(traffic, dict.fromkeys(FOUR, 1), {}, prompt=other + 100)
    loads = {A: 4, B: 1, C: 1, D: 1}  # 7 in flight: plain bound ceil(1.25 * 8 / 4) = 3
    decision = policy.choose(shared_prompt_state(traffic, loads, {A: 36}, prompt=7))
    assert decision.load_bound == 3
    assert (decision.backend, decision.route) == (A, Route.OWNER)


def test_a_hot_shared_prompt_spreads_at_the_plain_bound() -> None:
    # The same shape, but every request carries this one system prompt: more than one
    # replica's share, so its holder keeps only what the plain bound allows.
    traffic = Traffic(ManualClock(), SETTINGS)
    for _ in range(40):
        shared_prompt_state(traffic, dict.fromkeys(FOUR, 1), {A: 36}, prompt=7)
    loads = {A: 4, B: 1, C: 1, D: 1}
    decision = policy.choose(shared_prompt_state(traffic, loads, {A: 36}, prompt=7))
    assert decision.backend != A
    assert decision.route is Route.OVERFLOW


def test_prompt_shares_decay_with_the_recent_half_life() -> None:
    clock = ManualClock()
    traffic = Traffic(clock, Settings(recent_half_life=10.0))
    first, second = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]  # two 5-block shared prompts
    assert traffic.prompt_share(first, 5, count=True) == 1.0
    for _ in range(30):
        traffic.prompt_share(second, 5, count=True)
    assert traffic.prompt_share(first, 5, count=False) == pytest.approx(2 / 32)
    clock.advance(100.0)  # ten half-lives: what came before weighs 1/1024
    seen = traffic.prompt_share(first, 5, count=False)
    assert seen > 0.9
    assert traffic.prompt_share(first, 5, count=True) == pytest.approx(seen)
    assert traffic.prompt_share([1, 2], 2, count=True) == 0.0  # shorter than the minimum match


def two_choices(key: int) -> tuple[str, str]:
    ring = HashRing(FOUR)
    walk = ring.walk(key)
    return next(walk), next(walk)


def test_a_new_prefix_takes_the_less_used_of_its_two_ring_backends() -> None:
    first, second = two_choices(777)
    recent = dict.fromkeys(FOUR, 1.0) | {first: 9.0}
    decision = policy.choose(state(recent=recent, key=777))
    assert (decision.backend, decision.route) == (second, Route.HASH)


def test_a_new_prefix_goes_where_its_prefill_starts_sooner() -> None:
    # The first ring backend is the less used but has a prompt's prefill still to compute;
    # the second is busier, though within the hot cap (mean 1.5 + slack 2).
    first, second = two_choices(777)
    recent = dict.fromkeys(FOUR, 1.0) | {second: 3.0}
    assert policy.choose(state(recent=recent, key=777)).backend == first
    waiting = dataclasses.replace(state(recent=recent, key=777), pending_prefill={first: 120})
    decision = policy.choose(waiting)
    assert (decision.backend, decision.route) == (second, Route.HASH)


def test_an_overflow_copy_goes_where_its_prefill_starts_sooner() -> None:
    # A holds the prompt but is over the bound; of the two ring backends past the match, the
    # one with nothing pending takes the copy.
    full = state(loads={A: 30}, matched={A: 38})
    ring = HashRing(FOUR)
    candidates = [name for name in ring.walk(HASHES[38]) if name != A][:2]
    for busy, idle in (candidates, candidates[::-1]):
        decision = policy.choose(dataclasses.replace(full, pending_prefill={busy: 80}))
        assert (decision.backend, decision.route) == (idle, Route.OVERFLOW)


def test_the_policy_takes_its_knobs_from_settings() -> None:
    first, second = two_choices(777)
    busier_first = state(recent=dict.fromkeys(FOUR, 1.0) | {first: 3.0}, key=777)
    assert policy.choose(busier_first).backend == second
    one_choice = Settings(backend=("x:1",), ring_choices=1)
    assert build_policy(one_choice).choose(busier_first).backend == first
    owner_case = state(loads={A: 3, B: 1, C: 1, D: 1}, matched={A: 38, B: 4})
    assert policy.choose(owner_case).route is Route.OWNER
    wide_margin = Settings(backend=("x:1",), owner_margin_blocks=35)  # A holds 34 more than B
    decision = build_policy(wide_margin).choose(owner_case)
    assert (decision.backend, decision.route) == (B, Route.PREFIX)


def test_with_nothing_in_flight_a_shared_prompt_leaves_a_replica_that_had_most_requests() -> None:
    # Two holders of a hot prompt, all idle: the deeper one took far more of the recent
    # requests, so it passes the next on, and one cache does not hold every conversation
    # while the other replicas idle.
    recent = {A: 9.0, B: 1.0, C: 1.0, D: 1.0}
    idle = dataclasses.replace(
        state(matched={A: 10, B: 8}, recent=recent), shared_share=1.0, private_from=10
    )
    assert policy.choose(idle).backend == B
    spread = dataclasses.replace(idle, recent=dict.fromkeys(FOUR, 2.0))
    assert policy.choose(spread).route is Route.PREFIX


def test_a_first_turn_sharing_a_question_s_opening_words_is_no_conversation_history() -> None:
    # A holds the system prompt (10 blocks) and one block past it: another conversation's
    # question began with the same words. For a first turn that is no history of its own, so
    # A keeps it only as the owner of a cold shared prompt; this one is hot, so it spreads.
    recent = {A: 9.0, B: 1.0, C: 1.0, D: 1.0}
    opening = dataclasses.replace(
        state(matched={A: 11, B: 6}, recent=recent), shared_share=1.0, private_from=10
    )
    assert policy.choose(opening).backend == A  # taken for the conversation's own history
    first = policy.choose(dataclasses.replace(opening, first_turn=True))
    assert (first.backend, first.route) == (B, Route.PREFIX)


def test_a_new_session_takes_its_first_eligible_ring_backend_not_the_least_used() -> None:
    # Concurrent first requests of one session (or through several gateways) must agree: a
    # busier backend within the hot cap keeps them, one past it passes them on.
    first, second = two_choices(777)
    recent = dict.fromkeys(FOUR, 1.0) | {first: 3.0}
    keyed = RoutingState(FOUR, dict.fromkeys(FOUR, 0), HASHES, {}, 777, keyed=True, recent=recent)
    assert policy.choose(keyed).backend == first
    hot = dataclasses.replace(keyed, recent=recent | {first: 9.0})
    assert policy.choose(hot).backend == second


def test_the_router_state_decides_as_plain_snapshots_do() -> None:
    # The router shows the policy live views and running sums instead of per-request copies.
    clock = ManualClock(100.0)
    traffic = RecentTraffic(clock, SETTINGS.recent_half_life)
    pool = BackendPool()
    for name in FOUR:
        pool.add(Backend(name, f"http://{name}", frozenset({"m"}), healthy=True))
    group = pool.serving("m")
    assert group is not None
    rng = random.Random(5)
    for _ in range(200):
        traffic.add(rng.choice(FOUR))
        clock.advance(rng.random())
        pool.get(rng.choice(FOUR)).load_sampled(rng.randrange(4))  # type: ignore[union-attr]
        matched = {name: rng.randrange(0, 12) for name in rng.sample(FOUR, 2)}
        key = rng.randrange(1 << 32)
        loads = {name: pool.get(name).load for name in FOUR}  # type: ignore[union-attr]
        live = RoutingState(
            group.names,
            group.loads,
            HASHES,
            matched,
            key,
            recent=traffic.view,
            members=group.members,
            total_load=group.total_load,
            recent_total=traffic.sum_over(group.members),
        )
        copied = RoutingState(FOUR, loads, HASHES, matched, key, recent=traffic.snapshot(FOUR))
        assert group.total_load == sum(loads.values())
        assert traffic.sum_over(group.members) == pytest.approx(sum(copied.recent.values()))
        assert PrefixPolicy(SETTINGS).choose(live) == PrefixPolicy(SETTINGS).choose(copied)


def test_the_load_tally_follows_leases_scrapes_and_health() -> None:
    pool = BackendPool()
    for name in (A, B):
        pool.add(Backend(name, f"http://{name}", frozenset({"m"}), healthy=True))
    pool.rebuild()
    a, b = pool.get(A), pool.get(B)
    assert a is not None and b is not None
    with pool.lease(a), pool.lease(b), pool.lease(b):
        b.load_sampled(5)
        group = pool.serving("m")
        assert group is not None and group.total_load == 8
        pool.set_health(b, False)  # b leaves the candidates: its load leaves the tally
        group = pool.serving("m")
        assert group is not None and group.total_load == 1
        b.load_sampled(0)
        assert group.total_load == 1
    assert group.total_load == 0
    pool.set_health(b, True)
    assert pool.serving("m").total_load == 0  # type: ignore[union-attr]


def test_a_busy_owner_of_a_cold_shared_prompt_shares_it() -> None:
    # As in the cold case, but A has drawn far more than its share of recent requests.
    traffic = Traffic(ManualClock(), SETTINGS)
    for other in range(40):
        shared_prompt_state(traffic, dict.fromkeys(FOUR, 1), {}, prompt=other + 100)
    loads = {A: 4, B: 1, C: 1, D: 1}
    calm = dataclasses.replace(
        shared_prompt_state(traffic, loads, {A: 36}, prompt=7), recent=dict.fromkeys(FOUR, 10.0)
    )
    assert policy.choose(calm).backend == A
    busy = dataclasses.replace(calm, recent=dict.fromkeys(FOUR, 10.0) | {A: 16.0})
    assert policy.choose(busy).backend != A


def test_holders_of_a_cold_shared_prompt_take_its_requests_in_its_own_ring_order() -> None:
    # Two replicas hold a customer's prompt in whole (an earlier overflow made the copy). Every
    # request, whatever its question or the replicas' loads, goes to the same one of them while
    # it may take it, as every gateway of a fleet would: the other copy is left to age out.
    traffic = Traffic(ManualClock(), SETTINGS)
    for other in range(200):  # the prompt stays cold through the requests below
        shared_prompt_state(traffic, dict.fromkeys(FOUR, 1), {}, prompt=other % 50 + 100)
    home = 7 * 1000 + 35  # the prompt's last block
    first, second = (name for name in HashRing(FOUR).walk(home) if name in (B, C))
    chosen = set()
    for question in range(20):
        given = shared_prompt_state(traffic, {A: 1, B: 1, C: 1, D: 1}, {B: 36, C: 36}, 7)
        given = dataclasses.replace(
            given,
            hashes=[*given.hashes[:36], key_hash(f"question {question}"), *given.hashes[37:]],
            pending_prefill={first: 80 * (question % 2)},
        )
        decision = policy.choose(given)
        assert decision.route is Route.PREFIX
        chosen.add(decision.backend)
    assert chosen == {first}
    full = shared_prompt_state(traffic, {A: 0, B: 0, C: 0, D: 0} | {first: 5}, {B: 36, C: 36}, 7)
    assert policy.choose(full).backend == second


def test_a_conversation_owner_is_not_capped_by_its_recent_requests() -> None:
    # A's 30 blocks past the first user message are this request's own history: A keeps it
    # however busy it has been lately; a shared prompt's owner would yield (test above).
    recent = dict.fromkeys(FOUR, 10.0) | {A: 40.0}
    decision = policy.choose(state(loads=BUSY, matched={A: 30}, recent=recent))
    assert (decision.backend, decision.route) == (A, Route.OWNER)


def plain_allowance(given: RoutingState) -> Allowance:
    """The documented plain allowance: B and the hot cap, at any load."""
    count = len(given.candidates)
    total = given.summed_load()
    bound = load_bound(total, count, SETTINGS.load_factor, SETTINGS.load_floor)
    if not given.recent:
        return Allowance(bound)
    mean = sum(given.recent.get(name, 0.0) for name in given.candidates) / count
    return Allowance(bound, max(SETTINGS.recent_cap * mean, mean + SETTINGS.recent_slack))


loads_strategy = st.fixed_dictionaries({name: st.integers(0, 9) for name in FOUR})
depths = st.dictionaries(st.sampled_from(FOUR), st.integers(0, 40), max_size=4)
recents = st.dictionaries(st.sampled_from(FOUR), st.floats(0.0, 30.0), max_size=4)
pendings = st.dictionaries(st.sampled_from(FOUR), st.integers(0, 200), max_size=4)


@given(
    loads=loads_strategy,
    matched=depths,
    recent=recents,
    pending=pendings,
    sticky=st.sampled_from([None, *FOUR]),
    private_from=st.integers(0, 40),
    shared_share=st.floats(0.0, 1.0),
    first_turn=st.booleans(),
    keyed=st.booleans(),
    key=st.integers(0, (1 << 64) - 1),
)
@settings(max_examples=400, deadline=None)
def test_every_choice_keeps_to_its_rule(
    loads: dict[str, int],
    matched: dict[str, int],
    recent: dict[str, float],
    pending: dict[str, int],
    sticky: str | None,
    private_from: int,
    shared_share: float,
    first_turn: bool,
    keyed: bool,
    key: int,
) -> None:
    given_state = RoutingState(
        FOUR,
        loads,
        HASHES,
        matched,
        key,
        private_from=private_from,
        first_turn=first_turn,
        sticky=sticky,
        keyed=keyed,
        recent=recent,
        shared_share=shared_share,
        pending_prefill=pending,
    )
    decision = policy.choose(given_state)
    plain = plain_allowance(given_state)
    bound_only = Allowance(plain.load_bound)
    assert decision.backend in FOUR
    assert decision.load_bound == plain.load_bound
    assert PrefixPolicy(SETTINGS).choose(given_state) == decision  # nothing but the state
    if decision.route in (Route.PREFIX, Route.OVERFLOW, Route.HASH):
        assert eligible(given_state, decision.backend, plain)
    elif decision.route is Route.FALLBACK:
        assert not any(eligible(given_state, name, plain) for name in FOUR)
        assert eligible(given_state, decision.backend, bound_only)
    elif decision.route is Route.SESSION:
        assert decision.backend == sticky
        assert eligible(given_state, decision.backend, bound_only)
    else:
        assert decision.route is Route.OWNER
        others = [depth for name, depth in matched.items() if name != decision.backend]
        assert matched[decision.backend] - max(others, default=0) >= SETTINGS.owner_margin_blocks
        most = math.ceil(plain.load_bound * 2 * SETTINGS.load_factor)  # the stretch at s = 1
        assert eligible(given_state, decision.backend, Allowance(most))
        if first_turn or matched[decision.backend] <= private_from:  # a shared prompt: cold
            assert shared_share <= SETTINGS.load_factor / len(FOUR)
    if decision.route is Route.PREFIX:
        deeper = [
            name
            for name, depth in matched.items()
            if depth > matched[decision.backend] and eligible(given_state, name, plain)
        ]
        assert matched[decision.backend] >= SETTINGS.min_match_blocks and not deeper
