"""Routing-quality benchmark: the shapes of prefix sharing through the gateway, per policy.

For every workload and policy it starts fresh emulated replicas (finite caches, a prefill and
decode time model) and a gateway in front of them, drives the workload with a bounded number of
concurrent sessions, and prints one table: prompt tokens, prefilled tokens (prompt tokens not
reported as cached), the fewest possible for that workload (one unbounded cache that saw every
earlier request), token hit rate from observed `cached_tokens`, requests per replica
(max/mean) and time to first token; then a second table, per shape of request, of the tokens
and of the requests each replica served (read from the replica's response ids, so it is the
same for every router). With `--runs N` it does all of it N times and ends with a summary per
workload and router: the range of the hit rate and of max/mean, and the median TTFT.

    python loadtest/benchmark.py                      # every workload, every policy
    python loadtest/benchmark.py --workloads conversation --policies prefix,round_robin
    python loadtest/benchmark.py --policies prefix,sglang-cache_aware --runs 3
    python loadtest/benchmark.py --policies prefix,sglang-cache_aware,vllm-router-cache_aware

The replicas answer vLLM's render endpoints (`--enable-scale-out`), which vLLM's router asks to
route on the engine's tokens; `--no-render` leaves them answering 403, as a default vLLM does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import shlex
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtest.peers import PEERS, peer_versions, start_peer
from prefix_gateway.emulator.prefix_cache import block_hashes
from prefix_gateway.emulator.prompts import chat_prompt_ids
from prefix_gateway.emulator.replicas import EmulatedReplicas
from prefix_gateway.routing.policies import POLICIES
from prefix_gateway.workloads import SHAPES, Session, build_workload
from tests.support import GatewayProcess

MODEL = "bench-model"
BLOCK = 16
_JSON = {"content-type": "application/json"}


@dataclass
class Outcome:
    messages: list[dict[str, str]]
    answer: str
    prompt_tokens: int
    cached_tokens: int
    ttft: float
    status: int
    sent_at: float = 0.0
    done_at: float = 0.0
    shape: str = ""
    replica: str = ""
    """The serving replica's response-id prefix, the same for every router."""


@dataclass
class Run:
    outcomes: list[Outcome] = field(default_factory=list)
    failures: int = 0


async def one_request(
    http: aiohttp.ClientSession,
    url: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    extra: dict[str, object] | None = None,
) -> Outcome:
    body = orjson.dumps(
        {
            "model": MODEL,
            "messages": messages,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            **(extra or {}),
        }
    )
    started = time.perf_counter()
    ttft = 0.0
    parts: list[str] = []
    usage: dict[str, object] = {}
    replica = ""
    async with http.post(url + "/v1/chat/completions", data=body, headers=_JSON) as response:
        if response.status != 200:
            await response.read()
            return Outcome(list(messages), "", 0, 0, 0.0, response.status)
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = orjson.loads(line[6:])
            replica = replica or replica_of(chunk.get("id"))
            for choice in chunk.get("choices") or []:
                content = choice.get("delta", {}).get("content")
                if content:
                    if not parts:
                        ttft = time.perf_counter() - started
                    parts.append(content)
            if chunk.get("usage"):
                usage = chunk["usage"]
    details = usage.get("prompt_tokens_details") or {}
    assert isinstance(details, dict)
    return Outcome(
        list(messages),
        "".join(parts),
        int(usage.get("prompt_tokens", 0)),  # type: ignore[call-overload]
        int(details.get("cached_tokens") or 0),
        ttft,
        200,
        started,
        time.perf_counter(),
        replica=replica,
    )


def replica_of(response_id: object) -> str:
    """The replica part of an emulated replica's response id (`chatcmpl-<replica><serial>`):
    it tells which replica served a request through any router, ours or a peer."""
    if not isinstance(response_id, str) or "-" not in response_id:
        return ""
    return response_id.split("-", 1)[1][:8]


async def run_session(
    http: aiohttp.ClientSession,
    url: str,
    session: Session,
    run: Run,
    extra: dict[str, object] | None = None,
) -> None:
    messages = [{"role": "system", "content": session.system}]
    for question in session.questions:
        messages.append({"role": "user", "content": question})
        try:
            outcome = await one_request(http, url, messages, session.max_tokens, extra)
        except (aiohttp.ClientError, TimeoutError):
            run.failures += 1
            return
        outcome.shape = session.shape
        run.outcomes.append(outcome)
        if outcome.status != 200:
            run.failures += 1
            return
        messages.append({"role": "assistant", "content": outcome.answer})


async def drive(
    url: str,
    sessions: list[Session],
    concurrency: int,
    stagger: float,
    extra: dict[str, object] | None = None,
) -> Run:
    """Run `sessions`, `concurrency` at a time; `extra` joins every request's body."""
    run = Run()
    queue: asyncio.Queue[Session] = asyncio.Queue()
    for session in sessions:
        queue.put_nowait(session)
    # aiohttp, not httpx: at a third of the CPU per streamed request, the client on this
    # 2-core machine stays out of the way of the time to first token it measures.
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:

        async def worker(position: int) -> None:
            # Sessions begin over a short ramp, as real traffic does, not all in one instant.
            await asyncio.sleep(position * stagger)
            while not queue.empty():
                await run_session(http, url, queue.get_nowait(), run, extra)

        await asyncio.gather(*(worker(position) for position in range(concurrency)))
    return run


def fewest_prefill(outcomes: list[Outcome], replicas: int = 1, balance: float = 1.25) -> int:
    """Prefill with one unbounded cache and the same timing.

    A prompt block is reusable once the request that computed it has finished its prefill
    (its first token came back), an answer block once its request is done; a request can only
    reuse what was reusable when it was sent.

    With several replicas and no replica allowed more than `balance` times the mean number of
    requests, a block that R requests use must be computed on at least ceil(R / cap) replicas
    (cap = balance · requests / replicas): that many copies are added for it.
    """
    events: list[tuple[float, int, int, list[int]]] = []  # (time, order, kind, blocks)
    for outcome in outcomes:
        prompt = chat_prompt_ids(outcome.messages, None, "plain")
        answered = [*outcome.messages, {"role": "assistant", "content": outcome.answer}]
        prompt_blocks = block_hashes(prompt, BLOCK)
        events.append((outcome.sent_at, 1, len(prompt), prompt_blocks))
        events.append((outcome.sent_at + outcome.ttft, 0, 0, prompt_blocks))
        events.append(
            (outcome.done_at, 0, 0, block_hashes(chat_prompt_ids(answered, None, "plain"), BLOCK))
        )
    events.sort(key=lambda event: (event[0], event[1]))
    ready: set[int] = set()
    users: Counter[int] = Counter()
    total = 0
    for _, kind, prompt_tokens, blocks in events:
        if kind == 0:
            ready.update(blocks)
            continue
        hits = 0
        for block in blocks:
            if block not in ready:
                break
            hits += 1
        total += prompt_tokens - min(hits, (prompt_tokens - 1) // BLOCK) * BLOCK
        users.update(blocks)
    if replicas > 1:
        cap = max(1.0, balance * len(outcomes) / replicas)
        total += sum((math.ceil(count / cap) - 1) * BLOCK for count in users.values())
    return total


def percentile(values: list[float], share: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def summarise(workload: str, policy: str, run: Run, counts: list[float]) -> dict[str, object]:
    """`counts`: requests each replica finished during the run, from its own metrics."""
    done = [outcome for outcome in run.outcomes if outcome.status == 200]
    prompt, cached = token_totals(done)
    mean = statistics.mean(counts) if counts else 0.0
    ttfts = [outcome.ttft * 1000 for outcome in done]
    return {
        "workload": workload,
        "policy": policy,
        "requests": len(done),
        "failed": run.failures,
        "prompt": prompt,
        "prefilled": prompt - cached,
        "fewest": fewest_prefill(done),
        "fewest_balanced": fewest_prefill(done, len(counts)),
        "hit_rate": cached / prompt if prompt else 0.0,
        "max_mean": max(counts) / mean if mean else 0.0,
        "ttft_p50": percentile(ttfts, 0.5),
        "ttft_p99": percentile(ttfts, 0.99),
    }


def token_totals(done: list[Outcome]) -> tuple[int, int]:
    """Prompt tokens and cached prompt tokens over `done`, as the replicas reported them."""
    return (
        sum(outcome.prompt_tokens for outcome in done),
        sum(outcome.cached_tokens for outcome in done),
    )


def by_shape(workload: str, policy: str, run: Run, replicas: list[str]) -> list[dict[str, object]]:
    """Per shape of request: tokens, hit rate, TTFT p99 and where each request went (requests
    per replica, in the fleet's order), which shows how a router places each kind of traffic
    and whose requests wait for it."""
    rows = []
    shapes = sorted({outcome.shape for outcome in run.outcomes})
    for shape in shapes:
        done = [o for o in run.outcomes if o.status == 200 and o.shape == shape]
        prompt, cached = token_totals(done)
        where = Counter(outcome.replica for outcome in done)
        rows.append(
            {
                "workload": workload,
                "policy": policy,
                "shape": shape,
                "requests": len(done),
                "prompt": prompt,
                "prefilled": prompt - cached,
                "hit_rate": cached / prompt if prompt else 0.0,
                "ttft_p99": percentile([outcome.ttft * 1000 for outcome in done], 0.99),
                "per_replica": " / ".join(str(where.get(name, 0)) for name in replicas),
            }
        )
    return rows


def print_shape_table(rows: list[dict[str, object]]) -> None:
    print(
        "| workload | policy | shape | requests | prompt tok | prefilled tok | hit rate "
        "| TTFT p99 ms | requests per replica |"
    )
    print("|" + "---|" * 9)
    for row in rows:
        print(
            f"| {row['workload']} | {row['policy']} | {row['shape']} | {row['requests']} "
            f"| {row['prompt']:,} | {row['prefilled']:,} | {row['hit_rate']:.1%} "
            f"| {row['ttft_p99']:.1f} | {row['per_replica']} |",
            flush=True,
        )


def replica_ids(fleet: EmulatedReplicas) -> list[str]:
    """Each replica's response-id prefix, in the fleet's order, from one direct request."""
    ids = []
    for replica in fleet.replicas:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
        response = httpx.post(replica.url + "/v1/completions", json=body, timeout=30)
        response.raise_for_status()
        ids.append(replica_of(response.json().get("id")))
    return ids


def print_table(rows: list[dict[str, object]]) -> None:
    header = (
        "| workload | policy | requests | failed | prompt tok | prefilled tok | fewest (1 cache) "
        "| fewest (balanced) | hit rate | max/mean req | TTFT p50 ms | TTFT p99 ms |"
    )
    print(header)
    print("|" + "---|" * 12)
    for row in rows:
        print(
            f"| {row['workload']} | {row['policy']} | {row['requests']} | {row['failed']} "
            f"| {row['prompt']:,} | {row['prefilled']:,} | {row['fewest']:,} "
            f"| {row['fewest_balanced']:,} "
            f"| {row['hit_rate']:.1%} | {row['max_mean']:.2f} "
            f"| {row['ttft_p50']:.1f} | {row['ttft_p99']:.1f} |",
            flush=True,
        )


def finished_per_replica(fleet: EmulatedReplicas) -> list[float]:
    return [replica.metric("vllm:request_success_total") for replica in fleet.replicas]


def start_router(
    stack: contextlib.ExitStack, policy: str, workers: list[str], gateway_args: str
) -> str:
    """Our gateway with `policy`, or a peer router by its name in loadtest/peers.py."""
    if policy in PEERS:
        peer = start_peer(policy, workers, MODEL)
        stack.callback(peer.stop)
        return peer.router.url
    gateway = GatewayProcess(workers, "--policy", policy, *shlex.split(gateway_args))
    stack.enter_context(gateway)
    return gateway.url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(SHAPES))
    parser.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"our policies and peer routers: {', '.join([*POLICIES, *PEERS])}",
    )
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--cache-blocks", type=int, default=1024)
    parser.add_argument("--gateway-args", default="", help="extra flags for the gateway")
    parser.add_argument(
        "--stagger",
        type=float,
        default=0.05,
        help="seconds between the starts of the concurrent session loops",
    )
    parser.add_argument("--prefill-us-per-token", type=float, default=50.0)
    parser.add_argument("--decode-ms-per-token", type=float, default=0.2)
    parser.add_argument(
        "--runs",
        type=int,
        default=1,
        help="repeat everything this many times and end with a summary over the runs",
    )
    parser.add_argument(
        "--render",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the replicas answer vLLM's render endpoints, as vLLM with --enable-scale-out",
    )
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
        *(["--enable-scale-out"] if args.render else []),
    ]
    peers = peer_versions(args.policies.split(","))
    print(
        f"# {args.replicas} emulated replicas, {args.cache_blocks} cache blocks of {BLOCK} tokens "
        f"each, prefill {args.prefill_us_per_token} us/token, decode {args.decode_ms_per_token} "
        f"ms/token, render endpoints {'on' if args.render else 'off (403)'}; "
        f"{args.concurrency} concurrent sessions started {args.stagger} s apart; "
        f"seed {args.seed}, scale {args.scale}" + (f"; peers: {peers}" if peers else ""),
        flush=True,
    )
    runs = []
    for number in range(1, args.runs + 1):
        rows, shape_rows = run_suite(args, emulator_args)
        if args.runs > 1:
            print(f"\n## Run {number} of {args.runs}\n")
        print_table(rows)
        print()
        print_shape_table(shape_rows)
        runs.append(rows)
    if args.runs > 1:
        print(f"\n## Over the {args.runs} runs\n")
        print_summary(runs)


def run_suite(
    args: argparse.Namespace, emulator_args: list[str]
) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    """Every workload through every router once, each on fresh replicas."""
    rows: list[dict[str, object]] = []
    shape_rows: list[dict[str, object]] = []
    for workload in args.workloads.split(","):
        sessions = build_workload(workload, args.seed, args.scale)
        for policy in args.policies.split(","):
            with (
                EmulatedReplicas(args.replicas, MODEL, emulator_args) as fleet,
                contextlib.ExitStack() as stack,
            ):
                url = start_router(stack, policy, fleet.urls, args.gateway_args)
                replicas = replica_ids(fleet)
                before = finished_per_replica(fleet)
                run = asyncio.run(drive(url, sessions, args.concurrency, args.stagger))
                after = finished_per_replica(fleet)
            counts = [end - start for start, end in zip(before, after, strict=True)]
            rows.append(summarise(workload, policy, run, counts))
            shape_rows.extend(by_shape(workload, policy, run, replicas))
            print(f"done: {workload} / {policy}", file=sys.stderr, flush=True)
    return rows, shape_rows


def print_summary(runs: list[list[dict[str, object]]]) -> None:
    """Per workload and router over repeated runs: the range of the hit rate and of max/mean,
    and the median TTFT (a p99 over a few hundred requests moves a lot from run to run)."""
    print(
        "| workload | policy | runs | hit rate | max/mean req | TTFT p50 ms (median) "
        "| TTFT p99 ms (median) | TTFT p99 ms (each run) |"
    )
    print("|" + "---|" * 8)
    for position, first in enumerate(runs[0]):
        same = [rows[position] for rows in runs]
        hits = [float(row["hit_rate"]) for row in same]  # type: ignore[arg-type]
        spread = [float(row["max_mean"]) for row in same]  # type: ignore[arg-type]
        p50s = [float(row["ttft_p50"]) for row in same]  # type: ignore[arg-type]
        p99s = [float(row["ttft_p99"]) for row in same]  # type: ignore[arg-type]
        print(
            f"| {first['workload']} | {first['policy']} | {len(same)} "
            f"| {_range(hits, '.1%')} | {_range(spread, '.2f')} "
            f"| {statistics.median(p50s):.1f} | {statistics.median(p99s):.1f} "
            f"| {', '.join(f'{value:.1f}' for value in p99s)} |",
            flush=True,
        )


def _range(values: list[float], spec: str) -> str:
    low, high = min(values), max(values)
    if format(low, spec) == format(high, spec):
        return format(low, spec)
    return f"{format(low, spec)}–{format(high, spec)}"


if __name__ == "__main__":
    main()
