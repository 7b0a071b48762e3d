"""A replica that stalls behind a live health check, under steady streamed load.

Four emulated replicas behind one gateway; clients stream chat completions without pause,
each with a 30 s timeout. After the warm-up one replica's engine stops producing tokens while
its `/health` still answers (`POST /emulator/stall`); later it resumes. Prints whether any
request failed, how long the gateway took to take the replica out and to let it back in, and
time to first token before, during and after.

    python loadtest/stall.py
    python loadtest/stall.py --clients 16 --stall-after 10 --stalled-for 20 --runs 3
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prefix_gateway.emulator.replicas import EmulatedReplicas
from tests.support import GatewayProcess

MODEL = "stall-model"
CLIENT_TIMEOUT = 30.0


@dataclass
class Run:
    started: float = field(default_factory=time.monotonic)
    ttfts: list[tuple[float, float]] = field(default_factory=list)
    """(when it was sent, seconds to its first byte) of every request that succeeded."""
    failures: list[str] = field(default_factory=list)
    cut: int = 0
    """Streams begun on the replica when it stalled, ended with the upstream_stalled event."""
    lock: threading.Lock = field(default_factory=threading.Lock)


def client(url: str, worker: int, run: Run, stop: threading.Event) -> None:
    turn = 0
    with httpx.Client(timeout=CLIENT_TIMEOUT) as http:
        while not stop.is_set():
            turn += 1
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"client {worker} turn {turn} go on"}],
                "max_tokens": 32,
                "stream": True,
            }
            sent = time.monotonic()
            try:
                with http.stream("POST", url + "/v1/chat/completions", json=body) as response:
                    first = None
                    text = []
                    for chunk in response.iter_text():
                        first = first or time.monotonic()
                        text.append(chunk)
                whole = "".join(text)
                if response.status_code == 200 and '"code":"upstream_stalled"' in whole:
                    with run.lock:
                        run.cut += 1
                    continue
                if response.status_code != 200 or '"error"' in whole or "[DONE]" not in whole:
                    raise RuntimeError(f"{response.status_code}: {whole[-160:]}")
                with run.lock:
                    run.ttfts.append((sent, (first or sent) - sent))
            except Exception as error:  # a failed request is what this measures
                with run.lock:
                    run.failures.append(f"{type(error).__name__}: {error}")


def wait_for(condition: Callable[[], bool], seconds: float) -> float | None:
    """Seconds until `condition()` held (polled every 50 ms), or None."""
    began = time.monotonic()
    while time.monotonic() - began < seconds:
        if condition():
            return time.monotonic() - began
        time.sleep(0.05)
    return None


def stalled(gateway: GatewayProcess, name: str) -> bool:
    listing = httpx.get(gateway.url + "/admin/backends", timeout=5).json()["data"]
    return any(item["name"] == name and item["stalled"] for item in listing)


def serving(gateway: GatewayProcess, name: str) -> bool:
    listing = httpx.get(gateway.url + "/admin/backends", timeout=5).json()["data"]
    return any(item["name"] == name and item["healthy"] for item in listing)


def p(values: list[float], quantile: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(quantile * len(ordered)))] * 1000


def one_run(args: argparse.Namespace) -> dict[str, object]:
    replica_args = ["--decode-ms-per-token", "4", "--prefill-us-per-token", "50"]
    with (
        EmulatedReplicas(4, MODEL, replica_args) as replicas,
        GatewayProcess(replicas.urls, "--health-interval", "1") as gateway,
    ):
        run = Run()
        stop = threading.Event()
        clients = [
            threading.Thread(target=client, args=(gateway.url, worker, run, stop))
            for worker in range(args.clients)
        ]
        for thread in clients:
            thread.start()
        time.sleep(args.stall_after)
        # The replica with the most requests in flight stalls: one with none would hold up
        # nobody, and the gateway could not tell (nor need to).
        listing = httpx.get(gateway.url + "/admin/backends", timeout=5).json()["data"]
        stuck = max(listing, key=lambda item: item["in_flight"])["name"]
        stuck_url = f"http://{stuck}"
        stall_at = time.monotonic()
        httpx.post(stuck_url + "/emulator/stall", json={"stalled": True})
        detected = wait_for(lambda: stalled(gateway, stuck), args.stalled_for)
        time.sleep(max(0.0, args.stalled_for - (time.monotonic() - stall_at)))
        resume_at = time.monotonic()
        httpx.post(stuck_url + "/emulator/stall", json={"stalled": False})
        readmitted = wait_for(lambda: serving(gateway, stuck), 60)
        time.sleep(args.stall_after)
        stop.set()
        for thread in clients:
            thread.join(CLIENT_TIMEOUT + 5)
    phases = {
        "before": [ttft for sent, ttft in run.ttfts if sent < stall_at],
        "stalled": [ttft for sent, ttft in run.ttfts if stall_at <= sent < resume_at],
        "after": [ttft for sent, ttft in run.ttfts if sent >= resume_at],
    }
    return {
        "requests": len(run.ttfts) + len(run.failures) + run.cut,
        "failed": len(run.failures),
        "cut": run.cut,
        "first_failures": run.failures[:3],
        "detected": detected,
        "readmitted": readmitted,
        "phases": phases,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--stall-after", type=float, default=8.0, help="seconds of warm-up")
    parser.add_argument("--stalled-for", type=float, default=15.0)
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    print(
        f"# {args.clients} streaming clients ({CLIENT_TIMEOUT:g} s timeout), 4 replicas; one"
        f" stalls after {args.stall_after:g} s for {args.stalled_for:g} s"
    )
    print(
        "| run | requests | failed | streams cut by the stall | stall detected after s"
        " | readmitted after s | TTFT p50/p99 ms before | during | after |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for number in range(1, args.runs + 1):
        result = one_run(args)
        phases = result["phases"]
        assert isinstance(phases, dict)
        cells = [
            f"{p(phases[phase], 0.5):.0f} / {p(phases[phase], 0.99):.0f}"
            for phase in ("before", "stalled", "after")
        ]
        detected, readmitted = result["detected"], result["readmitted"]
        print(
            f"| {number} | {result['requests']} | {result['failed']} | {result['cut']} "
            f"| {detected if detected is None else f'{detected:.1f}'} "
            f"| {readmitted if readmitted is None else f'{readmitted:.1f}'} "
            f"| {' | '.join(cells)} |",
            flush=True,
        )
        for failure in result["first_failures"]:  # type: ignore[attr-defined]
            print(f"  failure: {failure}")


if __name__ == "__main__":
    main()
