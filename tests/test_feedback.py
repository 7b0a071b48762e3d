"""Cache feedback, piece by piece: the verdict, the chain links, and pruning a real index."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest

from prefix_gateway.backends.pool import BackendPool
from prefix_gateway.config import Settings
from prefix_gateway.metrics import Metrics
from prefix_gateway.prompt.parsing import Endpoint, parse_request
from prefix_gateway.proxy.usage import Observation
from prefix_gateway.routing.feedback import ChainLinks, ReportedDepth, chars_per_token, judge
from prefix_gateway.routing.placement import Placement
from prefix_gateway.routing.policies import build_policy
from prefix_gateway.routing.recorder import Stores
from prefix_gateway.routing.router import Router
from prefix_gateway.routing.types import Outcome
from prefix_gateway.state.index import InMemoryPrefixIndex
from prefix_gateway.state.sessions import InMemorySessionStore
from tests.words import words


def test_chars_per_token_is_the_requests_own_unless_unreported() -> None:
    assert chars_per_token(600, 100, 4.0) == 6.0
    assert chars_per_token(600, None, 4.0) == 4.0
    assert chars_per_token(600, 0, 4.0) == 4.0


@pytest.mark.parametrize(
    ("cached", "outcome", "first_missing"),
    [
        (160, ReportedDepth.CONFIRMED, 10),  # exactly the prediction
        (137, ReportedDepth.CONFIRMED, 10),  # short by less than the tolerance (24)
        (135, ReportedDepth.SHALLOWER, 9),  # 135 + 24 tokens reach into block 9
        (0, ReportedDepth.SHALLOWER, 1),  # 24 tokens = 96 characters: block 1
        (185, ReportedDepth.DEEPER, 10),
    ],
)
def test_judge_compares_within_the_tolerance(
    cached: int, outcome: ReportedDepth, first_missing: int
) -> None:
    # 10 blocks of 64 characters at 4 characters per token: 160 tokens predicted.
    verdict = judge(10, cached, 4.0, 64, 24)
    assert verdict.predicted_tokens == 160
    assert (verdict.outcome, verdict.first_missing) == (outcome, first_missing)


def test_judge_allows_a_share_of_the_prediction() -> None:
    # 100 blocks = 1,600 tokens; 10 % of that widens the tolerance to 184 tokens.
    assert judge(100, 1420, 4.0, 64, 24, 0.1).outcome is ReportedDepth.CONFIRMED
    assert judge(100, 1410, 4.0, 64, 24, 0.1).outcome is ReportedDepth.SHALLOWER
    assert judge(100, 1410, 4.0, 64, 24).outcome is ReportedDepth.SHALLOWER


def test_judge_never_blames_an_unpredicted_or_unreached_block() -> None:
    assert judge(0, 0, 4.0, 64, 24).outcome is ReportedDepth.CONFIRMED
    # The tolerance alone reaches past the prediction (16 tokens): nothing surely missing.
    assert judge(1, 0, 4.0, 64, 24).outcome is ReportedDepth.CONFIRMED
    assert judge(2, 0, 4.0, 64, 24).outcome is ReportedDepth.SHALLOWER
    # A ratio that puts the reach beyond the last predicted block still names one inside.
    shallow = judge(3, 0, 30.0, 64, 1)
    assert shallow.outcome is ReportedDepth.SHALLOWER and shallow.first_missing == 0
    assert judge(12, 0, 2.0, 64, 24).first_missing == 0
    assert judge(12, 64, 8.0, 64, 0).first_missing == 8


def tree() -> ChainLinks:
    links = ChainLinks()
    for chain in ([1, 2, 3, 4], [1, 2, 5, 6], [1, 2, 3, 7], [1, 8]):
        links.add(chain, 0.0)
    return links


def test_branches_are_the_chains_leaving_the_path_below_the_start() -> None:
    links = tree()
    assert len(links) == 8  # every block: 1, 2, 3, 5 with successors, 4, 6, 7, 8 ends
    # Below block 1 of [1, 2, 3, 4]: 5-6 leaves at block 2, 7 at block 3; 8 leaves above.
    assert links.branches([1, 2, 3, 4], 1) == [[7], [5, 6]]
    assert links.branches([1, 2, 3, 4], 0) == [[7], [5, 6], [8]]
    assert links.branches([1, 2, 3, 4], 3) == []
    assert links.branches([9, 10], 0) == []


def test_branches_continue_past_the_end_of_the_path() -> None:
    # A shorter prompt: every longer chain through its last block went through it too.
    runs = tree().branches([1, 2], 1)
    assert sorted(block for run in runs for block in run) == [3, 4, 5, 6, 7]
    assert_deepest_first(tree(), runs)


def assert_deepest_first(links: ChainLinks, runs: list[list[int]]) -> None:
    """Every block below a run's blocks is in an earlier run or the same one, so forgetting the
    runs in order keeps every chain in the index a prefix."""
    forgotten: set[int] = set()
    for run in runs:
        for block in run:
            below = {deeper for branch in links.branches([block], 0) for deeper in branch}
            assert below <= forgotten | set(run)
        assert not forgotten & set(run)
        forgotten.update(run)


def test_only_chains_added_before_a_time_are_branches() -> None:
    links = ChainLinks()
    links.add([1, 2, 3], 1.0)
    links.add([1, 2, 4], 2.0)
    links.add([1, 2, 5, 6], 3.0)
    assert links.branches([1, 2, 9], 1, before=2.5) == [[4], [3]]
    # A subtree is as recent as its most recent chain: 3-7 makes all of 3's subtree new.
    links.add([1, 2, 3, 7], 4.0)
    assert links.branches([1, 2, 9], 1, before=3.5) == [[5, 6], [4]]
    assert links.branches([1, 2, 9], 1) == [[5, 6], [4], [3, 7]]


def test_the_limit_keeps_whole_subtrees() -> None:
    links = ChainLinks()
    links.add([1, 2, 3, 4, 5], 0.0)  # a subtree of 3 below block 2
    links.add([1, 2, 6], 0.0)  # a subtree of 1
    # 3 + 1 blocks fit in 4, not in 3: the first subtree that does not fit ends the list.
    assert links.branches([1, 2, 9], 1, limit=4) == [[6], [3, 4, 5]]
    assert links.branches([1, 2, 9], 1, limit=3) == [[3, 4, 5]]
    assert links.branches([1, 2, 9], 1, limit=2) == []


def test_full_links_drop_the_deepest_blocks_of_the_least_recent_chain() -> None:
    links = ChainLinks(max_blocks=5)
    links.add([1, 2, 3, 4], 0.0)
    links.add([1, 2, 3, 4], 1.0)  # used again: still four blocks
    assert len(links) == 4
    links.add([9, 10], 2.0)  # six: the oldest, the older chain's end, goes (3 still links it)
    assert len(links) == 5
    assert links.branches([1], 0) == [[2, 3, 4]]
    links.add([1, 2], 3.0)  # refreshes 1 and 2, so 3 is now the oldest, then 10
    links.add([11, 12], 4.0)
    assert len(links) == 5
    assert links.branches([1], 0) == [[2, 3]]  # 3's link to 4 went with it
    assert links.branches([9], 0) == [[10]]


def test_a_block_followed_by_several_keeps_each_once() -> None:
    links = ChainLinks()
    for _ in range(3):
        links.add([1, 2], 0.0)
        links.add([1, 3], 0.0)
        links.add([1, 4], 0.0)
    assert links.branches([1, 5], 0) == [[4], [3], [2]]
    links.add([1, 2, 7], 0.0)  # a chain's end that gains a successor
    assert links.branches([1, 5], 0) == [[4], [3], [2, 7]]


MODEL = "m"


class Harness:
    """A router with a real in-memory index, and the feedback it would get."""

    def __init__(self) -> None:
        self.settings = Settings(backend=(f"{MODEL}=http://a:1", f"{MODEL}=http://b:1"))
        self.pool = BackendPool.from_specs(self.settings.backend)
        for backend in self.pool.backends:
            self.pool.set_health(backend, True)
        self.index = InMemoryPrefixIndex(600, 100_000)
        self.metrics = Metrics()
        self.router = Router(
            self.settings,
            self.pool,
            Stores(self.index, InMemorySessionStore(600, 1000)),
            build_policy(self.settings),
            self.metrics,
        )
        assert self.router.memory.feedback is not None
        self.feedback = self.router.memory.feedback

    def route(self, messages: list[dict[str, str]]) -> Placement:
        body = orjson.dumps({"model": MODEL, "messages": messages})
        return asyncio.run(self.router.route(parse_request(Endpoint.CHAT, body, None)))

    def answered(self, routed: Placement, seen: Observation) -> None:
        """As the proxy does: the replica accepts the request, then its outcome is settled."""
        outcome = Outcome(
            200,
            routed.decision,
            (routed.backend.name,),
            seen.prompt_tokens,
            seen.cached_tokens,
            seen.answer,
            seen.sent_at,
            accepted=(routed.backend.name,),
        )
        asyncio.run(routed.settle(outcome))

    def depth(self, routed: Placement) -> int:
        matched = asyncio.run(self.index.match(MODEL, routed.chain))
        return matched.get(routed.backend.name, 0)

    def counted(self, outcome: str) -> float:
        value = self.metrics.registry.get_sample_value(
            "gateway_index_feedback_total",
            {"model": MODEL, "backend": "a:1", "outcome": outcome},
        )
        value = value or 0.0
        other = self.metrics.registry.get_sample_value(
            "gateway_index_feedback_total",
            {"model": MODEL, "backend": "b:1", "outcome": outcome},
        )
        return value + (other or 0.0)


RATIO = 6.0
"""Characters per token the replica's reports imply (the emulator's: one word, one token)."""


def usage(routed: Placement, cached: int | None = None, answer: str = "") -> Observation:
    """A report of `cached` tokens; by default exactly what the index predicted."""
    prompt_tokens = round(len(routed.request.canonical) / RATIO)
    if cached is None:
        cached = round(routed.decision.matched_blocks * routed_block_chars() / RATIO)
    return Observation(prompt_tokens, cached, [answer] if answer else [])


def routed_block_chars() -> int:
    return Settings().block_chars


def test_a_shallow_report_prunes_the_other_chains_through_the_missing_block() -> None:
    harness = Harness()
    system = {"role": "system", "content": words(400, "fs")}
    first = harness.route([system, {"role": "user", "content": words(200, "fa")}])
    harness.answered(first, usage(first, 0, words(100, "fx")))
    second = harness.route([system, {"role": "user", "content": words(200, "fb")}])
    assert second.backend == first.backend and second.decision.matched_blocks > 30
    harness.answered(second, usage(second))
    assert harness.counted("confirmed") == 2  # the first predicted nothing and got nothing
    full_first = harness.depth(first)
    assert full_first == len(first.chain)
    # The first conversation's next turn is indexed too, through its recorded answer.
    follow = harness.route(
        [
            system,
            {"role": "user", "content": words(200, "fa")},
            {"role": "assistant", "content": words(100, "fx")},
            {"role": "user", "content": "and?"},
        ]
    )
    assert follow.decision.matched_blocks > full_first
    harness.answered(follow, usage(follow))

    # The replica evicted everything: a third question finds none of the system prompt.
    third = harness.route([system, {"role": "user", "content": words(200, "fc")}])
    assert third.backend == first.backend
    predicted = third.decision.matched_blocks
    harness.answered(third, usage(third, 0))
    assert harness.counted("shallower") == 1
    shared = sum(1 for a, b in zip(first.chain, third.chain, strict=False) if a == b)
    # The first chain (and the turn that extends it) keep only what the third recomputed.
    assert harness.depth(first) == shared < full_first
    assert harness.depth(follow) == shared
    assert harness.depth(third) == len(third.chain) >= predicted  # its own chain stays
    pruned = harness.metrics.registry.get_sample_value(
        "gateway_index_feedback_pruned_blocks_total",
        {"model": MODEL, "backend": first.backend.name},
    )
    assert pruned == len(follow.chain) - shared + len(second.chain) - shared


def test_a_confirmed_report_prunes_nothing() -> None:
    harness = Harness()
    system = {"role": "system", "content": words(300, "fk")}
    first = harness.route([system, {"role": "user", "content": words(50, "fk1")}])
    harness.answered(first, usage(first))
    second = harness.route([system, {"role": "user", "content": words(50, "fk2")}])
    short_of = round(second.decision.matched_blocks * routed_block_chars() / RATIO) - 20
    harness.answered(second, usage(second, short_of))
    assert harness.counted("confirmed") == 2 and harness.counted("shallower") == 0
    assert harness.depth(first) == len(first.chain)


def test_batches_and_unreported_usage_are_left_alone() -> None:
    harness = Harness()
    body = orjson.dumps({"model": MODEL, "prompt": [words(300, "fb1"), words(300, "fb2")]})
    batch = asyncio.run(harness.router.route(parse_request(Endpoint.COMPLETIONS, body, None)))
    harness.answered(batch, Observation(600, 0))
    single = harness.route([{"role": "user", "content": words(300, "fb3")}])
    harness.answered(single, Observation(300, None))
    for outcome in ReportedDepth:
        assert harness.counted(outcome.value) == 0


def test_a_burst_on_a_new_prefix_prunes_nothing_still_being_computed() -> None:
    # Two questions after a new system prompt, the second sent while the first is computed:
    # the replica has no system prompt for it yet, but evicted nothing.
    harness = Harness()
    system = {"role": "system", "content": words(400, "fn")}
    first = harness.route([system, {"role": "user", "content": words(200, "fn1")}])
    second = harness.route([system, {"role": "user", "content": words(200, "fn2")}])
    assert second.backend == first.backend and second.decision.matched_blocks > 0
    sent = time.perf_counter()
    harness.answered(first, usage(first))
    report = usage(second, 0)
    report.sent_at = sent
    harness.answered(second, report)
    assert harness.counted("shallower") == 1
    assert harness.depth(first) == len(first.chain)  # the first chain was not there yet
    # A third, sent once both had ended, and still finding nothing: now that is eviction.
    third = harness.route([system, {"role": "user", "content": words(200, "fn3")}])
    report = usage(third, 0)
    report.sent_at = time.perf_counter()
    harness.answered(third, report)
    assert harness.depth(first) < len(first.chain)
    assert harness.depth(second) < len(second.chain)
