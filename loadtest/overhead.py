"""Overhead benchmark: what the gateway adds on top of calling a replica directly.

One emulated replica with no simulated delay; the same requests sent directly, through the
gateway and through the yardstick of every run, vLLM's and SGLang's routers with round robin
(installed under `.peers/` on first use; `--peers` names others, `--peers ""` none). Prints:

1. one request at a time: latency p50/p99 of non-streamed requests and of the first streamed
   chunk, direct vs routed, and the difference;
2. under concurrency: requests per second and CPU milliseconds per request of the router
   process (user + system time from /proc).
3. each gateway's CPU per request over each peer's, measured in the same run.

    python loadtest/overhead.py
    python loadtest/overhead.py --sequential 2000 --concurrency 16,64 --requests 4000
    python loadtest/overhead.py --workers 1,2   # one gateway per worker count, side by side
    python loadtest/overhead.py --compare ../other-checkout   # another commit's gateway beside
    python loadtest/overhead.py --runs 3   # medians of three rounds under concurrency
    python loadtest/overhead.py --peers sglang-cache_aware,vllm-router-cache_aware
    python loadtest/overhead.py --peers ""   # the gateway alone (the yardstick is on by default)

The replica answers vLLM's render endpoints (`--enable-scale-out`): vLLM's router renders each
request into tokens there before it forwards it, and the replica's time for it is in that
router's latency (not in its CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtest.peers import PEERS, Router, peer_versions, start_peer
from prefix_gateway.emulator.process import EmulatorProcess
from tests.support import GatewayProcess

MODEL = "overhead-model"
YARDSTICK = "vllm-router-round_robin,sglang-round_robin"
"""The peers every run measures beside the gateway unless told otherwise: the fastest one's
CPU per request is what the gateway's is judged against (docs/benchmarks.md)."""
PROMPT = " ".join(f"w{index}" for index in range(200))


def body(stream: bool, tag: int) -> bytes:
    return orjson.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"{tag} {PROMPT}"}],
            "max_tokens": 8,
            "stream": stream,
        }
    )


def cpu_seconds(pid: int) -> float:
    """User + system time of `pid` and its live descendants (a gateway's worker processes)."""
    total = 0.0
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            with open(f"/proc/{current}/stat", encoding="ascii") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # exited meanwhile
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        pending.extend(children(current))
    return total


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except FileNotFoundError:
            continue
    return found


class Sequential:
    """One keep-alive connection, one request at a time."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.host, self.port = host, int(port)
        self._connect()

    def _connect(self) -> None:
        self.connection = http.client.HTTPConnection(self.host, self.port)
        self.connection.connect()
        # As a real client library does; without it small requests wait on delayed ACKs.
        assert self.connection.sock is not None
        self.connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def plain(self, tag: int) -> float:
        return self._timed(tag, stream=False)

    def first_chunk(self, tag: int) -> float:
        return self._timed(tag, stream=True)

    def _timed(self, tag: int, stream: bool) -> float:
        try:
            return self._once(tag, stream)
        except (http.client.HTTPException, ConnectionError):
            # A server closed the idle keep-alive connection: time the request on a new one.
            self.connection.close()
            self._connect()
            return self._once(tag, stream)

    def _once(self, tag: int, stream: bool) -> float:
        started = time.perf_counter()
        self.connection.request(
            "POST", "/v1/chat/completions", body(stream, tag), {"content-type": "application/json"}
        )
        response = self.connection.getresponse()
        if not stream:
            response.read()
            assert response.status == 200, response.status
            return time.perf_counter() - started
        first = response.read1(65536)
        elapsed = time.perf_counter() - started
        assert response.status == 200 and first, response.status
        response.read()
        return elapsed


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return (
        statistics.median(ordered) * 1000,
        ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000,
    )


def sequential_table(direct_url: str, routers: list[Router], count: int) -> None:
    clients = {"direct": Sequential(direct_url)}
    clients.update({router.name: Sequential(router.url) for router in routers})
    for client in clients.values():  # warm up connections and caches
        for tag in range(50):
            client.plain(tag)
            client.first_chunk(tag)
    samples: dict[tuple[str, str], list[float]] = {}
    kinds: dict[str, Callable[[Sequential, int], float]] = {
        "non-streamed": Sequential.plain,
        "first chunk": Sequential.first_chunk,
    }
    for tag in range(count):
        # Interleaved, so that drift of this shared machine hits every path alike.
        for name, client in clients.items():
            for kind, call in kinds.items():
                samples.setdefault((name, kind), []).append(call(client, tag + 1000))
    print(f"\n## One request at a time ({count} requests per path and kind)\n")
    print("| path | kind | p50 ms | p99 ms | added p50 ms | added p99 ms |")
    print("|---|---|---|---|---|---|")
    for (name, kind), values in samples.items():
        p50, p99 = percentiles(values)
        base50, base99 = percentiles(samples[("direct", kind)])
        print(
            f"| {name} | {kind} | {p50:.3f} | {p99:.3f} "
            f"| {p50 - base50:+.3f} | {p99 - base99:+.3f} |"
        )


async def hammer(url: str, concurrency: int, total: int, stream: bool) -> float:
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        counter = iter(range(total))

        async def worker() -> None:
            for tag in counter:
                async with session.post(
                    url + "/v1/chat/completions",
                    data=body(stream, tag),
                    headers={"content-type": "application/json"},
                ) as response:
                    await response.read()
                    assert response.status == 200, response.status

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - started


def concurrency_table(
    direct_url: str,
    routers: list[Router],
    levels: list[int],
    total: int,
    stream: bool,
    runs: int = 1,
) -> None:
    """Each router's requests/s and CPU per request at each level: with `runs` > 1, the
    median of that many rounds, the routers in a rotated order each round (so that drift of
    this shared machine hits them alike), and every round's CPU figure."""
    kind = "streamed" if stream else "non-streamed"
    print(f"\n## Under concurrency ({total} {kind} requests, {runs} round(s))\n")
    print("| path | concurrency | requests/s | router CPU ms/request | runs |")
    print("|---|---|---|---|---|")
    for level in levels:
        rates: dict[str, list[float]] = {}
        costs: dict[str, list[float]] = {}
        for round_number in range(runs):
            elapsed = asyncio.run(hammer(direct_url, level, total, stream))
            rates.setdefault("direct", []).append(total / elapsed)
            shift = round_number % max(1, len(routers))
            for router in routers[shift:] + routers[:shift]:
                before = cpu_seconds(router.pid)
                elapsed = asyncio.run(hammer(router.url, level, total, stream))
                cpu = cpu_seconds(router.pid) - before
                rates.setdefault(router.name, []).append(total / elapsed)
                costs.setdefault(router.name, []).append(cpu / total * 1000)
        print(f"| direct | {level} | {statistics.median(rates['direct']):,.0f} | - | |")
        for router in routers:
            spent = costs[router.name]
            each = ", ".join(f"{cost:.3f}" for cost in spent) if runs > 1 else ""
            print(
                f"| {router.name} | {level} | {statistics.median(rates[router.name]):,.0f} "
                f"| {statistics.median(spent):.3f} | {each} |",
                flush=True,
            )
        ratio_table(routers, costs, level, kind)


def ratio_table(
    routers: list[Router], costs: dict[str, list[float]], level: int, kind: str
) -> None:
    """Each gateway's median CPU per request over each peer's, in this run."""
    ours = [router for router in routers if router.name.startswith("prefix-gateway")]
    peers = [router for router in routers if not router.name.startswith("prefix-gateway")]
    if not ours or not peers:
        return
    print(
        f"\n| {kind}, concurrency {level}: CPU over | " + " | ".join(p.name for p in peers) + " |"
    )
    print("|---|" + "---|" * len(peers))
    for gateway in ours:
        mine = statistics.median(costs[gateway.name])
        over = (f"{mine / statistics.median(costs[peer.name]):.2f}x" for peer in peers)
        print(f"| {gateway.name} | " + " | ".join(over) + " |")


def _commit(checkout: str) -> str:
    import subprocess

    return subprocess.run(
        ["git", "-C", checkout, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequential", type=int, default=500)
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument(
        "--runs", type=int, default=1, help="rounds under concurrency; medians are printed"
    )
    parser.add_argument(
        "--peers",
        default=YARDSTICK,
        help=f'comma-separated, measured in the same run ("" for none): {", ".join(PEERS)}',
    )
    parser.add_argument(
        "--workers",
        default="1",
        help="comma-separated worker counts: one gateway (`serve --workers N`) for each",
    )
    parser.add_argument(
        "--compare",
        default="",
        help="comma-separated checkouts of other commits: each one's gateway runs beside ours",
    )
    args = parser.parse_args()
    counts = [int(count) for count in args.workers.split(",")]
    # --enable-scale-out: vLLM's router renders each request into tokens on the replica first.
    with (
        EmulatorProcess("--max-running", "1024", "--enable-scale-out", name=MODEL) as replica,
        contextlib.ExitStack() as stack,
    ):
        routers = []
        for count in counts:
            gateway = stack.enter_context(
                GatewayProcess([replica.url], "--health-interval", "30", "--workers", str(count))
            )
            name = "prefix-gateway" if counts == [1] else f"prefix-gateway --workers {count}"
            routers.append(Router(name, gateway.url, gateway.pid))
        for checkout in (path for path in args.compare.split(",") if path):
            other = stack.enter_context(
                GatewayProcess(
                    [replica.url], "--health-interval", "30", checkout=str(Path(checkout).resolve())
                )
            )
            routers.append(Router(f"prefix-gateway@{_commit(checkout)}", other.url, other.pid))
        names = [name for name in args.peers.split(",") if name]
        peers = [start_peer(name, [replica.url], MODEL) for name in names]
        try:
            routers += [peer.router for peer in peers]
            versions = peer_versions(names)
            print(
                f"# python {sys.version.split()[0]}, {os.cpu_count()} cores, no emulated delays"
                + (f"; peers: {versions}" if versions else "")
            )
            sequential_table(replica.url, routers, args.sequential)
            levels = [int(level) for level in args.concurrency.split(",")]
            for stream in (False, True):
                concurrency_table(replica.url, routers, levels, args.requests, stream, args.runs)
        finally:
            for peer in peers:
                peer.stop()


if __name__ == "__main__":
    main()
