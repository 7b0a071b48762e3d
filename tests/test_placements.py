"""loadtest/placements.py: the fixed placements put each shape where its docstring says, and
the script prints one row per placement with hit rates that agree with the replays."""

from __future__ import annotations

from loadtest.placements import MODELLED_PEER, ModelledCacheAware, replay
from prefix_gateway.replay.synthetic import synthetic_trace
from prefix_gateway.routing.policies import RoutingState
from tests.support import run_script


def per_replica(name: str, seed: int = 1) -> dict[str, tuple[int, ...]]:
    trace = synthetic_trace("mixed", seed, rate=74.0, think_seconds=0.0)
    return {shape.shape: shape.per_replica for shape in replay(trace, name).shapes}


def test_one_per_shape_keeps_every_shape_but_customers_on_one_replica() -> None:
    placed = per_replica("one-per-shape")
    assert placed["conversation"] == (96, 0, 0, 0)
    assert placed["rag"] == (0, 80, 0, 0)
    assert placed["shared"] == (0, 0, 80, 0)
    # Per-customer prompts fill the replicas the other shapes leave light.
    assert sum(placed["customers"]) == 120
    totals = [sum(counts) for counts in zip(*placed.values(), strict=True)]
    assert max(totals) / (sum(totals) / len(totals)) < 1.1


def test_rag_on_two_keeps_customers_off_the_rag_only_replica() -> None:
    placed = per_replica("rag-on-two")
    assert placed["rag"][0] == placed["rag"][3] == 0
    assert placed["rag"][1] > 0 and placed["rag"][2] > 0
    assert placed["customers"][1] == 0
    assert placed["conversation"] == (96, 0, 0, 0)
    assert placed["shared"] == (0, 0, 0, 80)


def test_pinned_rag_leaves_the_rest_to_the_policy() -> None:
    placed = per_replica("rag-on-one+prefix")
    assert placed["rag"] == (0, 80, 0, 0)
    assert sum(1 for count in placed["customers"] if count) > 1


def test_a_rag_only_replica_takes_nothing_else() -> None:
    placed = per_replica("rag-on-two+prefix, one rag-only")
    assert placed["rag"][0] == placed["rag"][3] == 0
    assert sum(placed["rag"]) == 80
    for shape in ("conversation", "customers", "shared"):
        assert placed[shape][1] == 0
    assert sum(1 for count in placed["customers"] if count) > 1


def route(peer: ModelledCacheAware, hashes: list[int], loads: dict[str, int] | None = None) -> str:
    names = ["a", "b", "c"]
    state = RoutingState(candidates=names, loads=loads or dict.fromkeys(names, 0), hashes=hashes)
    return peer.choose(state).backend


def test_modelled_cache_aware_follows_a_match_over_30_percent_else_the_smallest_tree() -> None:
    peer = ModelledCacheAware()
    assert route(peer, list(range(10))) == "a"  # all trees empty: the first
    assert route(peer, list(range(100, 105))) == "b"  # no match: the smallest tree
    assert route(peer, list(range(200, 203))) == "c"
    # 4 of 10 blocks held by "a" (40%) follow it; 3 of 10 (30%) do not, and go to "c", the
    # smallest tree.
    assert route(peer, [*range(4), *range(300, 306)]) == "a"
    assert route(peer, [*range(3), *range(400, 407)]) == "c"


def test_modelled_cache_aware_balances_only_past_both_thresholds() -> None:
    peer = ModelledCacheAware()
    route(peer, list(range(10)))
    # 65 requests apart, but not 1.5 times: the match still wins.
    assert route(peer, list(range(10)), {"a": 200, "b": 135, "c": 150}) == "a"
    # 65 apart and 1.5 times: the least loaded.
    assert route(peer, list(range(10)), {"a": 130, "b": 65, "c": 100}) == "b"


def test_the_script_prints_a_row_per_placement() -> None:
    output = run_script("loadtest/placements.py", "--seeds", "1", timeout=120)
    rows = {
        line.split("|")[1].strip(): line
        for line in output.splitlines()
        if line.startswith("| ") and not line.startswith(("| placement", "| seed"))
    }
    assert set(rows) == {
        "prefix",
        "one-per-shape",
        "rag-on-two",
        "rag-on-one+prefix",
        "rag-on-two+prefix",
        "rag-on-two+prefix, one rag-only",
        MODELLED_PEER,
        "1",
    }
    trace = synthetic_trace("mixed", 1, rate=74.0, think_seconds=0.0)
    for name, line in rows.items():
        if name != "1":
            assert f"| {replay(trace, name).hit_rate:.1%} |" in line
    # Seed 1, side by side.
    ours, peer = replay(trace, "prefix"), replay(trace, MODELLED_PEER)
    assert f"| {ours.hit_rate:.1%}, {ours.max_mean:.2f}," in rows["1"]
    assert f"| {peer.hit_rate:.1%}, {peer.max_mean:.2f}," in rows["1"]
