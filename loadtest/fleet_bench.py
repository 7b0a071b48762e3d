"""A fleet of gateways on one Redis or a Redis Cluster: does it decide as one gateway does?

For each workload (`customers`: many per-customer system prompts; `conversation`: six-turn
conversations under one system prompt) and each fleet (1, 3, 8 gateways on one redis-server; 3
on a three-master Redis Cluster), fresh emulated replicas with finite caches, a fresh Redis and
fresh gateway processes. Each session's requests go to the gateways in rotation, starting at
the session's own number, so consecutive requests of a session reach different gateways and
consecutive sessions start on different gateways. Printed per row: hit rate (cached / prompt
tokens as the replicas reported them), max/mean requests per replica, failed requests, Redis
calls per request (round trips, as the gateways count them) and commands per request
(from `INFO commandstats` before and after, those run inside scripts included), the exchange
of requests in flight counted apart and the routing decision's p50/p99 as the gateways timed it.

    python loadtest/redis_bench.py fleet --gateways 1,3,8 --cluster-gateways 3
    python loadtest/redis_bench.py fleet --workloads customers --gateways 8 --kill-redis 8

`--rotation request` sends every request to the next gateway in turn (one counter over all
sessions) and streams it, so a customer's consecutive requests never meet the same gateway
twice in a row; with `--workloads customer-prompts` (96 per-customer prompts of about 1,000
tokens, Zipf s = 0.8, 600 requests of one ~100-token question) and `--cache-blocks 2000
--concurrency 16 --think 0`, the caches cannot hold every prompt and only a fleet that
partitions them as one gateway does keeps them all warm. The column *new copies* counts the
requests that put a prompt on a replica other than the first that held it, by route;
*prompt misses* the requests that found less than half their prompt cached, by where they went,
then how many reached a replica while another request there was still computing their prompt
(the replicas' own count) and the replicas' mean time to first token. *fallbacks* are the
gateways' Redis operations answered locally or writes dropped, by operation.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shlex
import statistics
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtest.benchmark import percentile
from loadtest.fleet_clients import MODEL, Tally, drive, sessions_of
from loadtest.fleet_copies import print_copies
from prefix_gateway.emulator.replicas import EmulatedReplicas
from prefix_gateway.processes import metric_value
from prefix_gateway.workloads import Session
from tests.redis_server import RedisClusterServers, RedisServer
from tests.support import GatewayProcess

# Eight gateways, four replicas and Redis starting on two busy cores take their time.
_STARTUP_SECONDS = 120.0
# The commands of the exchange of requests in flight (`LOAD_SCRIPT`), one HSET per exchange.
_LOAD_COMMANDS = ("hset", "pexpire", "hgetall", "hdel", "time")


@dataclass
class Fleet:
    """What one row ran on: the Redis nodes and the gateways."""

    nodes: list[RedisServer]
    gateways: list[GatewayProcess]


def commandstats(nodes: Sequence[RedisServer]) -> dict[str, int]:
    """Calls per command, summed over the nodes (commands run inside scripts included)."""
    calls: dict[str, int] = {}
    for node in nodes:
        with contextlib.suppress(Exception):  # a node that is down counts nothing
            for line in node.cli("info", "commandstats").splitlines():
                if line.startswith("cmdstat_"):
                    name, _, fields = line[len("cmdstat_") :].partition(":")
                    count = int(fields.split(",")[0].split("=")[1])
                    calls[name.lower()] = calls.get(name.lower(), 0) + count
    return calls


def decision_percentiles(gateways: Sequence[GatewayProcess]) -> tuple[float, float]:
    """p50 and p99 of `gateway_routing_decision_seconds` over every gateway, in µs, linear
    within the histogram's buckets."""
    buckets: dict[float, float] = {}
    for gateway in gateways:
        text = gateway.metrics_text()
        for line in text.splitlines():
            if line.startswith("gateway_routing_decision_seconds_bucket"):
                bound = line.split('le="')[1].split('"')[0]
                upper = float("inf") if bound == "+Inf" else float(bound)
                buckets[upper] = buckets.get(upper, 0.0) + float(line.rsplit(" ", 1)[1])
    ordered = sorted(buckets.items())
    total = ordered[-1][1] if ordered else 0.0

    def quantile(share: float) -> float:
        wanted, lower, below = share * total, 0.0, 0.0
        for upper, count in ordered:
            if count >= wanted and count > below:
                if upper == float("inf"):
                    return lower * 1e6
                return (lower + (upper - lower) * (wanted - below) / (count - below)) * 1e6
            lower, below = upper, count
        return 0.0

    return (quantile(0.5), quantile(0.99)) if total else (0.0, 0.0)


@contextlib.contextmanager
def redis_nodes(kind: str) -> Iterator[tuple[str, list[RedisServer]]]:
    """The URL gateways are given and the nodes behind it: a cluster, one server, or none
    (`local`: each gateway keeps its index in its own memory)."""
    if kind == "local":
        yield "", []
    elif kind == "cluster":
        with RedisClusterServers() as cluster:
            yield cluster.url, cluster.nodes
    else:
        with RedisServer() as server:
            yield server.url, [server]


async def kill_and_restart(server: RedisServer, after: float, down: float) -> None:
    """SIGKILL Redis `after` seconds in, start it again (empty, same port) `down` later."""
    await asyncio.sleep(after)
    server.kill()
    await asyncio.sleep(down)
    await asyncio.to_thread(server.start)


@dataclass
class Row:
    workload: str
    gateways: int
    redis: str
    tally: Tally
    seconds: float
    calls: dict[str, int]
    decision_us: tuple[float, float]
    fallbacks: Counter[str]
    """Operations that fell back to local state (or dropped a write), by operation."""
    round_trips: float
    in_flight_misses: float
    """Requests that reached a replica while another request there was computing their
    prompt, as the replicas counted them."""
    replica_ttft: float
    """The replicas' mean time to first token, from arrival there (queue and prefill)."""
    resumed: str = ""


def run_row(
    workload: str,
    sessions: list[Session],
    count: int,
    kind: str,
    emulator_args: Sequence[str],
    gateway_args: Sequence[str],
    concurrency: int,
    think: float,
    kill: tuple[float, float] | None,
    rotation: str = "session",
    trace: bool = False,
    checkout: str | None = None,
) -> Row:
    with (
        redis_nodes(kind) as (url, nodes),
        EmulatedReplicas(4, MODEL, emulator_args) as replicas,
        contextlib.ExitStack() as stack,
    ):
        gateways = [
            stack.enter_context(
                GatewayProcess(
                    replicas.urls,
                    *(("--redis-url", url) if url else ()),
                    *gateway_args,
                    checkout=checkout,
                    startup_seconds=_STARTUP_SECONDS,
                )
            )
            for _ in range(count)
        ]
        urls = [gateway.url for gateway in gateways]
        before = commandstats(nodes)
        began = time.perf_counter()

        async def scenario() -> Tally:
            work = drive(urls, sessions, concurrency, think, rotation)
            if kill is None:
                return await work
            tally, _ = await asyncio.gather(work, kill_and_restart(nodes[0], *kill))
            return tally

        tally = asyncio.run(scenario())
        seconds = time.perf_counter() - began
        scraped = [httpx.get(f"{url}/metrics").text for url in replicas.urls]
        in_flight = sum(
            metric_value(text, "emulator_prefix_misses_in_flight_total") for text in scraped
        )
        first_tokens = [
            sum(metric_value(text, f"vllm:time_to_first_token_seconds_{part}") for text in scraped)
            for part in ("sum", "count")
        ]
        after = commandstats(nodes)
        resumed = ""
        if kill is not None:
            # The restarted server began empty: what it holds came after it was back.
            up = sum(gateway.metric("gateway_redis_up") for gateway in gateways)
            keys = int(nodes[0].cli("dbsize"))
            lookups = after.get("evalsha", 0) - after.get("hset", 0)
            resumed = f"{up:.0f} of {count} gateways up; {keys} keys, {lookups} lookups+writes"
            before = {}
        calls = {name: after.get(name, 0) - before.get(name, 0) for name in after}
        fallbacks: Counter[str] = Counter()
        for gateway in gateways:
            fallbacks.update(by_label(gateway.metrics_text(), "gateway_redis_fallbacks_total"))
        # Round trips per request as the gateways counted them, the exchange apart.
        round_trips = sum(
            gateway.metric("gateway_redis_operation_seconds_count")
            - gateway.metric("gateway_redis_operation_seconds_count", operation="load")
            for gateway in gateways
        )
        decision = decision_percentiles(gateways)
        if trace:
            print_copies([gateway.log() for gateway in gateways])
        if tally.failed:
            print_warnings([gateway.log() for gateway in gateways])
    return Row(
        workload,
        count,
        kind,
        tally,
        seconds,
        calls,
        decision,
        fallbacks,
        round_trips,
        in_flight,
        first_tokens[0] / max(1.0, first_tokens[1]),
        resumed,
    )


def by_label(text: str, name: str, label: str = "operation") -> Counter[str]:
    """The samples named `name` in Prometheus text `text`, summed by `label`."""
    found: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.value:
                found[sample.labels.get(label, "")] += round(sample.value)
    return found


def print_warnings(logs: Sequence[str]) -> None:
    """The gateways' warnings and errors, when a request failed: what the client cannot see."""
    for number, text in enumerate(logs):
        for line in text.splitlines():
            if "WARNING" in line or "ERROR" in line or "Traceback" in line:
                print(f"#   gateway {number}: {line[:300]}", flush=True)


def print_header() -> None:
    print(
        "| workload | gateways | Redis | requests | failed | hit rate | max/mean "
        "| replicas per system prompt | new copies; prompt misses | later turns moved | routes "
        "| Redis calls/req | commands/req | load exchanges/s | decision p50 µs | p99 µs "
        "| fallbacks | requests/s | latency p50 ms | p99 ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def print_row(row: Row) -> None:
    tally, calls = row.tally, row.calls
    exchanges = calls.get("hset", 0)
    load_commands = sum(calls.get(name, 0) for name in _LOAD_COMMANDS) + exchanges
    commands = sum(calls.values()) - load_commands
    requests = max(1, tally.requests)
    routes = ", ".join(f"{name} {number}" for name, number in sorted(tally.routes.items()))
    moved = f"{tally.moved} of {tally.later_turns}" if tally.later_turns else "–"
    if tally.moved_routes:
        moved += " (" + ", ".join(f"{n} {k}" for k, n in sorted(tally.moved_routes.items())) + ")"
    copies = ", ".join(f"{name} {n}" for name, n in sorted(tally.new_copies.items())) or "0"
    copies += "; misses: " + (", ".join(f"{k} {n}" for k, n in sorted(tally.misses.items())) or "0")
    copies += (
        f" ({row.in_flight_misses:.0f} while another computed it;"
        f" replica TTFT {1000 * row.replica_ttft:.0f} ms)"
    )
    fallbacks = ", ".join(f"{k} {n:.0f}" for k, n in sorted(row.fallbacks.items())) or "0"
    failed = str(tally.failed)
    if tally.failures:
        failed += " (" + "; ".join(f"{why}: {n}" for why, n in tally.failures.items()) + ")"
    label = row.redis if not row.resumed else f"{row.redis}, killed ({row.resumed})"
    print(
        f"| {row.workload} | {row.gateways} | {label} | {tally.requests} | {failed} "
        f"| {tally.cached / max(1, tally.prompt):.1%} | {tally.balance(4):.2f} "
        f"| {tally.copies():.2f} | {copies} | {moved} | {routes} "
        f"| {row.round_trips / requests:.2f} | {commands / requests:.1f} "
        f"| {exchanges / row.seconds:.0f} | {row.decision_us[0]:.0f} | {row.decision_us[1]:.0f} "
        f"| {fallbacks} | {tally.requests / row.seconds:.1f} "
        f"| {1000 * percentile(tally.latencies, 0.5):.0f} "
        f"| {1000 * percentile(tally.latencies, 0.99):.0f} |",
        flush=True,
    )


def numbers(listed: str) -> list[int]:
    return [int(part) for part in listed.split(",") if part]


def fleet(args: argparse.Namespace) -> None:
    """The rows `args` asks for (redis_bench.py's flags), printed as they finish."""
    workloads = [part for part in args.workloads.split(",") if part]
    gateways, seeds = numbers(args.gateways), numbers(args.seeds)
    scale, cache_blocks, concurrency, think = (
        args.scale,
        args.cache_blocks,
        args.concurrency,
        args.think,
    )
    gateway_args = args.gateway_args
    kill = (args.kill_redis, args.redis_down) if args.kill_redis else None
    emulator_args = [
        "--chat-template",
        "plain",
        "--cache-blocks",
        str(cache_blocks),
        "--prefill-us-per-token",
        "50",
        "--decode-ms-per-token",
        "0.2",
    ]
    extra = shlex.split(gateway_args)
    if args.trace_copies:
        extra += ["--log-level", "debug", "--log-format", "text"]
    print(
        f"# 4 emulated replicas of {cache_blocks} cache blocks of 16 tokens, prefill 50 us/token,"
        f" decode 0.2 ms/token; {concurrency} sessions at once, started 50 ms apart, {think} s"
        f" after each answer before the next request; "
        + (
            "every request to the next gateway in turn, streamed"
            if args.rotation == "request"
            else "a session's requests go to the gateways in rotation from its own number"
        )
        + f"; scale {scale}; gateway flags:"
        f" {gateway_args or '(defaults)'}"
        + (f"; Redis killed {kill[0]} s in, back {kill[1]} s later" if kill else "")
    )
    print_header()
    plans = [(count, "one") for count in gateways]
    plans += [(count, "cluster") for count in numbers(args.cluster_gateways)]
    plans += [(count, "local") for count in numbers(args.local_gateways)]
    summary: dict[tuple[str, int, str], list[Row]] = {}
    for workload in workloads:
        for seed in seeds:
            sessions = sessions_of(workload, seed, scale)
            for count, kind in plans:
                row = run_row(
                    f"{workload} (seed {seed})",
                    sessions,
                    count,
                    kind,
                    emulator_args,
                    extra,
                    concurrency,
                    think,
                    kill if kind == "one" and count == max(gateways) else None,
                    args.rotation,
                    args.trace_copies,
                    args.checkout,
                )
                print_row(row)
                summary.setdefault((workload, count, kind), []).append(row)
    if len(seeds) > 1:
        print_summary(summary)


def hit_rate(tally: Tally) -> float:
    return tally.cached / max(1, tally.prompt)


def print_summary(summary: dict[tuple[str, int, str], list[Row]]) -> None:
    """Per cell over the seeds; the gap is to one gateway on one Redis over the same seeds."""
    print(
        "\n| workload | gateways | Redis | seeds | failed | mean hit rate | mean gap | worst gap "
        "| mean max/mean | worst max/mean | replicas per system prompt |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (workload, count, kind), rows in summary.items():
        hits = [hit_rate(row.tally) for row in rows]
        balances = [row.tally.balance(4) for row in rows]
        alone = summary.get((workload, 1, "one"), [])
        gaps = [
            100 * (hit_rate(row.tally) - hit_rate(one.tally))
            for row, one in zip(rows, alone, strict=False)
        ]
        gap = f"{statistics.mean(gaps):+.1f} | {min(gaps):+.1f}" if gaps and count > 1 else "– | –"
        print(
            f"| {workload} | {count} | {kind} | {len(rows)} "
            f"| {sum(row.tally.failed for row in rows)} | {statistics.mean(hits):.1%} | {gap} "
            f"| {statistics.mean(balances):.2f} | {max(balances):.2f} "
            f"| {statistics.mean(row.tally.copies() for row in rows):.2f} |"
        )
