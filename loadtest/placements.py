"""Fixed placements of the mixed workload's shapes, replayed against the `prefix` policy.

A placement here knows each request's shape in advance, which no gateway does: it shows what
keeping the shapes apart is worth in hit rate on the mixed workload, and what it costs in time
to first token, under the same replay as `prefix-gateway replay` (four replicas, 16,384-token
caches, sessions at 74/s, no think time).

- `one-per-shape`: conversations, RAG and the shared prompt on a replica each; per-customer
  prompts, most requested first, each on the replica with the fewest requests so far.
- `rag-on-two`: RAG on the less loaded of replicas 1 and 2, conversations and the shared prompt
  on replicas 0 and 3; per-customer prompts packed as above onto replicas 0, 2 and 3, where
  RAG counts half on each of its two: one replica writes only RAG.
- `rag-on-one+prefix`, `rag-on-two+prefix`: RAG pinned as above (to replica 1, or to the less
  loaded of 1 and 2), everything else routed by the `prefix` policy, which sees all requests.
- `rag-on-two+prefix, one rag-only`: the same on two replicas, and the `prefix` policy routes
  the rest among replicas 0, 2 and 3: replica 1 writes only RAG.
- `cache_aware (model)`: SGLang router's `cache_aware` rule with its defaults (sglang-router
  0.3.2), on block hashes instead of characters, for the same replay. It knows no shapes. Each
  replica has a tree of the prompts sent to it, never trimmed at this size. A prompt whose
  longest match covers more than 30% of it goes to that replica; otherwise to the replica with
  the smallest tree. Only when the loads differ by more than 64 requests and by 1.5 times
  does it take the least loaded instead: 5 of the 4,512 requests of seeds 1-12.

The second table shows the `prefix` policy and the modelled `cache_aware` seed by seed. On
the seeds where `cache_aware` happens to stay within 1.25 × the mean requests, its hit rate
is what balanced placement can reach.

    python loadtest/placements.py --seeds 12
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace

from prefix_gateway.config import Settings
from prefix_gateway.emulator.config import EmulatorConfig
from prefix_gateway.emulator.timing import TimeModel
from prefix_gateway.replay.command import SYNTHETIC_CACHE_TOKENS
from prefix_gateway.replay.report import Summary, summarise
from prefix_gateway.replay.simulator import ReplayConfig, run_replay
from prefix_gateway.replay.synthetic import synthetic_trace
from prefix_gateway.replay.traces import Trace
from prefix_gateway.routing.policies import Decision, Policy, Route, RoutingState
from prefix_gateway.routing.prefix_policy import PrefixPolicy

REPLICAS = 4
MODELLED_PEER = "cache_aware (model)"
Placer = Callable[[RoutingState], int]


class FixedPlacement:
    """A policy that asks `place` for a replica's position among the candidates."""

    def __init__(self, place: Placer) -> None:
        self._place = place

    def choose(self, state: RoutingState) -> Decision:
        name = state.candidates[self._place(state)]
        return Decision(name, Route.PREFIX, state.matched.get(name, 0), 0)


class PinnedRag:
    """RAG on fixed replicas, the rest as the `prefix` policy decides; the policy is asked
    about every request, so its counts of recent traffic include RAG's. With `rag_only`, the
    rest never goes to that replica: the policy chooses among the others."""

    def __init__(
        self, trace: Trace, replicas: tuple[int, ...], rag_only: int | None = None
    ) -> None:
        self._rag = {r.hashes[0] for r in trace.requests if r.shape == "rag"}
        self._replicas = replicas
        self._rag_only = rag_only
        self._policy = PrefixPolicy(Settings())

    def choose(self, state: RoutingState) -> Decision:
        if state.hashes[0] in self._rag:
            self._policy.choose(state)
            name = state.candidates[_less_loaded(state, self._replicas)]
            return Decision(name, Route.PREFIX, state.matched.get(name, 0), 0)
        if self._rag_only is None:
            return self._policy.choose(state)
        others = [name for index, name in enumerate(state.candidates) if index != self._rag_only]
        # Sums over the candidates are the caller's; over a subset the policy takes its own.
        subset = replace(
            state,
            candidates=others,
            members=frozenset(others),
            total_load=None,
            recent_total=None,
        )
        return self._policy.choose(subset)


class ModelledCacheAware:
    """SGLang's `cache_aware` choice, on the prompt's block hashes (see the module's text)."""

    def __init__(
        self, cache_threshold: float = 0.3, balance_abs: int = 64, balance_rel: float = 1.5
    ) -> None:
        self._threshold = cache_threshold
        self._balance_abs = balance_abs
        self._balance_rel = balance_rel
        self._trees: dict[str, set[int]] = {}

    def choose(self, state: RoutingState) -> Decision:
        names = list(state.candidates)
        trees = [self._trees.setdefault(name, set()) for name in names]
        loads = [state.loads.get(name, 0) for name in names]
        most, least = max(loads), min(loads)
        if most - least > self._balance_abs and most > least * self._balance_rel:
            chosen = loads.index(least)
        else:
            # Block hashes are chained, so a held hash means its whole prefix is held.
            matched = [_leading(state.hashes, tree) for tree in trees]
            chosen = max(range(len(names)), key=matched.__getitem__)
            if matched[chosen] <= self._threshold * len(state.hashes):
                chosen = min(range(len(names)), key=lambda index: len(trees[index]))
        trees[chosen].update(state.hashes)
        name = names[chosen]
        return Decision(name, Route.PREFIX, state.matched.get(name, 0), 0)


def _leading(hashes: Sequence[int], tree: set[int]) -> int:
    """How many of the prompt's first blocks `tree` holds."""
    for depth, block in enumerate(hashes):
        if block not in tree:
            return depth
    return len(hashes)


def pack_customers(
    trace: Trace, counts: list[float], allowed: tuple[int, ...] = tuple(range(REPLICAS))
) -> dict[int, int]:
    """Each per-customer prompt (by its first block), most requested first, on the `allowed`
    replica with the fewest requests so far."""
    demand = Counter(r.hashes[0] for r in trace.requests if r.shape == "customers")
    home: dict[int, int] = {}
    for prompt, requests in demand.most_common():
        position = min(allowed, key=lambda index: counts[index])
        home[prompt] = position
        counts[position] += requests
    return home


def one_per_shape(trace: Trace) -> Placer:
    fixed, rag = {"conversation": 0, "shared": 2}, (1,)
    return _placer(trace, fixed, rag, pack_customers(trace, _counts(trace, fixed, rag)))


def rag_on_two(trace: Trace) -> Placer:
    fixed, rag = {"conversation": 0, "shared": 3}, (1, 2)
    customers = pack_customers(trace, _counts(trace, fixed, rag), allowed=(0, 2, 3))
    return _placer(trace, fixed, rag, customers)


def _counts(trace: Trace, fixed: dict[str, int], rag: tuple[int, ...]) -> list[float]:
    """Requests per replica of the shapes placed in advance; RAG's shared over its replicas."""
    counts = [0.0] * REPLICAS
    for request in trace.requests:
        if request.shape in fixed:
            counts[fixed[request.shape]] += 1
        elif request.shape == "rag":
            for index in rag:
                counts[index] += 1 / len(rag)
    return counts


def _placer(
    trace: Trace, fixed: dict[str, int], rag: tuple[int, ...], customers: dict[int, int]
) -> Placer:
    shape_of = {request.hashes[0]: request.shape for request in trace.requests}

    def place(state: RoutingState) -> int:
        shape = shape_of[state.hashes[0]]
        if shape == "rag":
            return _less_loaded(state, rag)
        return fixed[shape] if shape in fixed else customers[state.hashes[0]]

    return place


def _less_loaded(state: RoutingState, positions: tuple[int, ...]) -> int:
    """The position, among `positions` of the candidates, of the least loaded one."""
    return min(positions, key=lambda index: state.loads.get(state.candidates[index], 0))


PLACEMENTS: dict[str, Callable[[Trace], Policy]] = {
    "one-per-shape": lambda trace: FixedPlacement(one_per_shape(trace)),
    "rag-on-two": lambda trace: FixedPlacement(rag_on_two(trace)),
    "rag-on-one+prefix": lambda trace: PinnedRag(trace, (1,)),
    "rag-on-two+prefix": lambda trace: PinnedRag(trace, (1, 2)),
    "rag-on-two+prefix, one rag-only": lambda trace: PinnedRag(trace, (1, 2), rag_only=1),
    MODELLED_PEER: lambda trace: ModelledCacheAware(),
}


def replay(trace: Trace, name: str) -> Summary:
    config = ReplayConfig(
        replicas=REPLICAS,
        cache_tokens=SYNTHETIC_CACHE_TOKENS,
        time_model=TimeModel(50e-6, 0.2e-3),
        max_running=EmulatorConfig().max_running,
    )
    experiment = None if name == "prefix" else PLACEMENTS[name](trace)
    return summarise(run_replay(trace, "prefix", config, experiment))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=12, help="replay seeds 1..N")
    args = parser.parse_args()
    rows: dict[str, list[Summary]] = {name: [] for name in ("prefix", *PLACEMENTS)}
    for seed in range(1, args.seeds + 1):
        trace = synthetic_trace("mixed", seed, rate=74.0, think_seconds=0.0)
        for name, summaries in rows.items():
            summaries.append(replay(trace, name))
    print(f"Mixed workload, replay seeds 1-{args.seeds}: means over the seeds, worst max/mean.\n")
    print_means(rows)
    print("\nSeed by seed: hit rate, max/mean requests, TTFT p99 (RAG's TTFT p99).\n")
    print_seeds(rows["prefix"], rows[MODELLED_PEER])


def print_means(rows: dict[str, list[Summary]]) -> None:
    shapes = [shape.shape for shape in rows["prefix"][0].shapes]
    print(
        "| placement | hit rate | max/mean req (worst) | TTFT p50 ms | TTFT p99 ms | "
        + " | ".join(f"{shape} hit" for shape in shapes)
        + f" | TTFT p99 ms per shape ({' / '.join(shapes)}) |"
    )
    print("|---" * (6 + len(shapes)) + "|")
    for name, summaries in rows.items():
        by_shape = [
            statistics.mean(s.shapes[index].hit_rate for s in summaries)
            for index in range(len(shapes))
        ]
        print(
            f"| {name} | {statistics.mean(s.hit_rate for s in summaries):.1%} "
            f"| {max(s.max_mean for s in summaries):.2f} "
            f"| {statistics.mean(s.ttft_p50 for s in summaries) * 1000:.0f} "
            f"| {statistics.mean(s.ttft_p99 for s in summaries) * 1000:.0f} | "
            + " | ".join(f"{rate:.1%}" for rate in by_shape)
            + " | "
            + " / ".join(
                f"{statistics.mean(s.shapes[index].ttft_p99 for s in summaries) * 1000:,.0f}"
                for index in range(len(shapes))
            )
            + " |"
        )


def print_seeds(ours: list[Summary], peer: list[Summary]) -> None:
    print(f"| seed | prefix | {MODELLED_PEER} | {MODELLED_PEER} within 1.25 |")
    print("|---|---|---|---|")
    for seed, (mine, theirs) in enumerate(zip(ours, peer, strict=True), start=1):
        print(
            f"| {seed} | {_brief(mine)} | {_brief(theirs)} "
            f"| {'yes' if theirs.max_mean <= 1.25 else 'no'} |"
        )


def _brief(summary: Summary) -> str:
    rag = next(shape for shape in summary.shapes if shape.shape == "rag")
    return (
        f"{summary.hit_rate:.1%}, {summary.max_mean:.2f}, {summary.ttft_p99 * 1000:,.0f} ms "
        f"({rag.ttft_p99 * 1000:,.0f} ms)"
    )


if __name__ == "__main__":
    main()
