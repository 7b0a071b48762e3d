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

    python loadtest/placements.py --seeds 12
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter
from collections.abc import Callable

from gateway.emulator.config import EmulatorConfig
from gateway.emulator.timing import TimeModel
from gateway.policy import Decision, Policy, Route, RoutingState
from gateway.policy.prefix import PrefixPolicy
from gateway.replay.command import SYNTHETIC_CACHE_TOKENS
from gateway.replay.report import Summary, summarise
from gateway.replay.simulator import ReplayConfig, run_replay
from gateway.replay.synthetic import synthetic_trace
from gateway.replay.traces import Trace

REPLICAS = 4
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
    about every request, so its counts of recent traffic include RAG's."""

    def __init__(self, trace: Trace, replicas: tuple[int, ...]) -> None:
        self._rag = {r.hashes[0] for r in trace.requests if r.shape == "rag"}
        self._replicas = replicas
        self._policy = PrefixPolicy()

    def choose(self, state: RoutingState) -> Decision:
        decision = self._policy.choose(state)
        if state.hashes[0] not in self._rag:
            return decision
        name = state.candidates[_less_loaded(state, self._replicas)]
        return Decision(name, Route.PREFIX, state.matched.get(name, 0), 0)


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
    shapes = [shape.shape for shape in rows["prefix"][0].shapes]
    print(f"Mixed workload, replay seeds 1-{args.seeds}: means over the seeds, worst max/mean.\n")
    print(
        "| placement | hit rate | max/mean req (worst) | TTFT p50 ms | TTFT p99 ms | "
        + " | ".join(f"{shape} hit" for shape in shapes)
        + " |"
    )
    print("|---" * (5 + len(shapes)) + "|")
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
            + " |"
        )


if __name__ == "__main__":
    main()
