"""Uneven fleets: the shipped workloads with one replica computing slower, and a replica that
slows down and recovers in the middle of a run.

Table: for every workload, this gateway on an even fleet, then every router (this gateway and
the peers) on the same fleet with its first replica `--slowdown` times slower (prefill and
decode, the emulator's `--slowdown`): hit rate, TTFT p50 and p99 and the requests the slow
replica served, each on fresh replicas with the same request sequence (the harness of
loadtest/benchmark.py).

Follow (`--follow`): one gateway in front of an even fleet under a steady load of per-customer
prompts (`--concurrency` sessions, each one request); `--slow-at` seconds in, the first replica
turns `--slowdown` times slower (`POST /emulator/slowdown`), and `--recover-at` seconds in it
recovers. Its share of the requests sent in each second is printed, with how long after each
change its share over two seconds fell below `--lost-below` of its even share and rose back
above `--regained-above` of it.

    python loadtest/uneven.py --requests 600
    python loadtest/uneven.py --requests 600 --routers prefix --gateway-args=
    python loadtest/uneven.py --workloads customers,shared --routers prefix,sglang-cache_aware
    python loadtest/uneven.py --follow
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtest.benchmark import (
    MODEL,
    Run,
    drive,
    finished_per_replica,
    percentile,
    replica_ids,
    run_session,
    start_router,
    token_totals,
)
from loadtest.peers import PEERS, peer_versions
from prefix_gateway.emulator.replicas import EmulatedReplicas
from prefix_gateway.workloads import SHAPES, build_workload

DEFAULT_ROUTERS = "prefix,sglang-cache_aware,vllm-router-cache_aware"


def slow_down(url: str, factor: float) -> None:
    httpx.post(url + "/emulator/slowdown", json={"factor": factor}, timeout=10).raise_for_status()


def routes(url: str) -> str:
    """Requests per route label, from the gateway's metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    counts: dict[str, float] = {}
    ttft: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "gateway_requests_total":
                route = sample.labels["route"]
                counts[route] = counts.get(route, 0.0) + sample.value
            elif sample.name.startswith("gateway_ttft_"):
                ttft.setdefault(sample.labels["backend"], {})[sample.name] = sample.value
    predicted = ", ".join(
        f"{backend} {1000 * got.get('gateway_ttft_predicted_seconds_total', 0) / n:.0f}"
        f"/{1000 * got.get('gateway_ttft_observed_seconds_total', 0) / n:.0f} ms"
        for backend, got in sorted(ttft.items())
        if (n := got.get("gateway_ttft_predictions_total", 0))
    )
    by_route = ", ".join(f"{route} {count:.0f}" for route, count in sorted(counts.items()))
    return f"{by_route}; mean TTFT predicted/observed: {predicted}"


def per_replica(run: Run, ids: list[str]) -> str:
    """Requests and TTFT p99 per replica, in the fleet's order (the first is the slow one)."""
    parts = []
    for name in ids:
        ttfts = [o.ttft * 1000 for o in run.outcomes if o.status == 200 and o.replica == name]
        parts.append(f"{len(ttfts)} req p99 {percentile(ttfts, 0.99):.0f} ms")
    return " / ".join(parts)


def row(workload: str, fleet: str, router: str, run: Run, slow: float, total: float) -> str:
    done = [outcome for outcome in run.outcomes if outcome.status == 200]
    prompt, cached = token_totals(done)
    ttfts = [outcome.ttft * 1000 for outcome in done]
    return (
        f"| {workload} | {fleet} | {router} | {len(done)} | {run.failures} "
        f"| {cached / prompt if prompt else 0.0:.1%} | {percentile(ttfts, 0.5):.1f} "
        f"| {percentile(ttfts, 0.99):.1f} | {slow:.0f} of {total:.0f} |"
    )


def run_once(
    args: argparse.Namespace, emulator_args: list[str], workload: str, router: str, slowdown: float
) -> tuple[Run, float, float]:
    """`workload` through `router` on fresh replicas, the first `slowdown` times slower: the
    run, the requests the first replica finished and the requests all of them finished."""
    sessions = build_workload(workload, args.seed, scale_for(args, workload))
    with (
        EmulatedReplicas(args.replicas, MODEL, emulator_args) as fleet,
        contextlib.ExitStack() as stack,
    ):
        if slowdown != 1.0:
            slow_down(fleet.replicas[0].url, slowdown)
        url = start_router(stack, router, fleet.urls, args.gateway_args)
        before = finished_per_replica(fleet)
        run = asyncio.run(drive(url, sessions, args.concurrency, args.stagger))
        after = finished_per_replica(fleet)
        ids = replica_ids(fleet)
        if router not in PEERS:
            print(f"# {workload} / {router} x{slowdown:g}: {routes(url)}", file=sys.stderr)
        print(f"# {workload} / {router} x{slowdown:g}: {per_replica(run, ids)}", file=sys.stderr)
    counts = [end - start for start, end in zip(before, after, strict=True)]
    return run, counts[0], sum(counts)


def scale_for(args: argparse.Namespace, workload: str) -> float:
    """`--scale`, or the scale that gives `workload` about `--requests` requests."""
    if not args.requests:
        return float(args.scale)
    per_unit = sum(len(session.questions) for session in build_workload(workload, args.seed))
    return float(args.requests) / per_unit


def table(args: argparse.Namespace, emulator_args: list[str]) -> None:
    print(
        "| workload | fleet | router | requests | failed | hit rate | TTFT p50 ms | TTFT p99 ms "
        "| requests on the first replica |"
    )
    print("|" + "---|" * 9, flush=True)
    uneven = f"1 of {args.replicas} at {args.slowdown:g}x"
    for workload in args.workloads.split(","):
        cases = [("even", args.even_router, 1.0)] if args.even_router else []
        cases += [(uneven, router, args.slowdown) for router in args.routers.split(",") if router]
        for fleet, router, slowdown in cases:
            run, slow, total = run_once(args, emulator_args, workload, router, slowdown)
            print(row(workload, fleet, router, run, slow, total), flush=True)


async def _follow(args: argparse.Namespace, url: str, slow_url: str) -> Run:
    """Per-customer prompts, `--concurrency` sessions at a time, from the start until
    `--follow-after` seconds past the recovery; the first replica slows down and recovers."""
    sessions = iter(build_workload("customers", args.seed, 100.0))
    run = Run()
    began = time.perf_counter()
    deadline = began + args.recover_at + args.follow_after

    async def change() -> None:
        await asyncio.sleep(args.slow_at)
        await asyncio.to_thread(slow_down, slow_url, args.slowdown)
        print(f"# {time.perf_counter() - began:.1f} s: slowed down {args.slowdown:g}x", flush=True)
        await asyncio.sleep(args.recover_at - args.slow_at)
        await asyncio.to_thread(slow_down, slow_url, 1.0)
        print(f"# {time.perf_counter() - began:.1f} s: recovered", flush=True)

    connector = aiohttp.TCPConnector(limit=args.concurrency)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:

        async def worker(position: int) -> None:
            await asyncio.sleep(position * args.stagger)
            for session in sessions:
                if time.perf_counter() > deadline:
                    return
                await run_session(http, url, session, run)

        changing = asyncio.create_task(change())
        await asyncio.gather(*(worker(position) for position in range(args.concurrency)))
        await changing
    for outcome in run.outcomes:
        outcome.sent_at -= began
    return run


def follow(args: argparse.Namespace, emulator_args: list[str]) -> None:
    with (
        EmulatedReplicas(args.replicas, MODEL, emulator_args) as fleet,
        contextlib.ExitStack() as stack,
    ):
        url = start_router(stack, "prefix", fleet.urls, args.gateway_args)
        ids = replica_ids(fleet)
        run = asyncio.run(_follow(args, url, fleet.replicas[0].url))
    done = [outcome for outcome in run.outcomes if outcome.status == 200]
    end = int(max(outcome.sent_at for outcome in done)) + 1
    sent = [0] * end
    slow = [0] * end
    ttfts: list[list[float]] = [[] for _ in range(end)]
    for outcome in done:
        second = int(outcome.sent_at)
        sent[second] += 1
        slow[second] += outcome.replica == ids[0]
        ttfts[second].append(outcome.ttft * 1000)
    even = [slow[s] / sent[s] for s in range(2, int(args.slow_at)) if sent[s]]
    even_share = statistics.mean(even) if even else 1 / args.replicas
    print("| second | requests sent | on the slowed replica | its share | TTFT p99 ms |")
    print("|---|---|---|---|---|")
    for second in range(end):
        share = slow[second] / sent[second] if sent[second] else 0.0
        print(
            f"| {second} | {sent[second]} | {slow[second]} | {share:.0%} "
            f"| {percentile(ttfts[second], 0.99):.0f} |"
        )
    lost = _first_second(
        sent, slow, args.slow_at, lambda share: share < args.lost_below * even_share
    )
    regained = _first_second(
        sent, slow, args.recover_at, lambda share: share > args.regained_above * even_share
    )
    print(
        f"\neven share {even_share:.0%}; below {args.lost_below:.0%} of it "
        f"{_after(lost, args.slow_at)} after the slowdown; above {args.regained_above:.0%} of it "
        f"{_after(regained, args.recover_at)} after the recovery"
    )


def _first_second(sent: list[int], slow: list[int], since: float, test: object) -> int | None:
    """The first whole second from `since` on whose share (over it and the next) passes."""
    assert callable(test)
    for second in range(int(since), len(sent) - 1):
        count = sent[second] + sent[second + 1]
        if count and test((slow[second] + slow[second + 1]) / count):
            return second
    return None


def _after(second: int | None, since: float) -> str:
    if second is None:
        return "never"
    return f"{max(0.0, second - since):.0f}-{second + 2 - since:.0f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(SHAPES))
    parser.add_argument("--routers", default=DEFAULT_ROUTERS, help="on the uneven fleet")
    parser.add_argument("--even-router", default="prefix", help="on the even fleet (empty: none)")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--slowdown", type=float, default=3.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument(
        "--requests",
        type=int,
        default=0,
        help="scale each workload to about this many requests (0: --scale as given)",
    )
    parser.add_argument("--cache-blocks", type=int, default=2000)
    parser.add_argument("--prefill-us-per-token", type=float, default=50.0)
    parser.add_argument("--decode-ms-per-token", type=float, default=0.2)
    parser.add_argument("--stagger", type=float, default=0.05)
    parser.add_argument(
        "--gateway-args",
        default="--ttft-routing",
        help="flags for the gateway (default: the learned time to first token on)",
    )
    parser.add_argument("--follow", action="store_true", help="the slowdown mid-run instead")
    parser.add_argument(
        "--follow-after", type=float, default=15.0, help="seconds run past the recovery"
    )
    parser.add_argument("--slow-at", type=float, default=15.0)
    parser.add_argument("--recover-at", type=float, default=35.0)
    parser.add_argument("--lost-below", type=float, default=0.6)
    parser.add_argument("--regained-above", type=float, default=0.8)
    args = parser.parse_args()
    emulator_args = [
        "--chat-template",
        "plain",
        "--cache-blocks",
        str(args.cache_blocks),
        "--prefill-us-per-token",
        str(args.prefill_us_per_token),
        "--decode-ms-per-token",
        str(args.decode_ms_per_token),
        "--enable-scale-out",
    ]
    peers = peer_versions(args.routers.split(","))
    fleet = (
        f"# {args.replicas} emulated replicas, {args.cache_blocks} cache blocks of 16 tokens, "
        f"prefill {args.prefill_us_per_token} us/token, decode {args.decode_ms_per_token} "
        f"ms/token; {args.concurrency} concurrent sessions; seed {args.seed}"
        + (f"; gateway flags: {args.gateway_args}" if args.gateway_args else "")
    )
    if args.follow:
        print(
            f"{fleet}; per-customer prompts; the first replica {args.slowdown:g}x slower from "
            f"{args.slow_at:g} s to {args.recover_at:g} s",
            flush=True,
        )
    else:
        print(
            f"{fleet}; the first replica {args.slowdown:g}x slower on the uneven fleet; "
            + (
                f"about {args.requests} requests a workload"
                if args.requests
                else f"scale {args.scale}"
            )
            + (f"; peers: {peers}" if peers else ""),
            flush=True,
        )
    if args.follow:
        follow(args, emulator_args)
    else:
        table(args, emulator_args)


if __name__ == "__main__":
    main()
