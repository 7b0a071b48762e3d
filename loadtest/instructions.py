"""Instructions per proxied request, counted by valgrind's callgrind: a figure that does not
move with the machine's load, for comparing commits where CPU time is too noisy.

The gateway runs under callgrind in front of one emulated replica without delay; it is sent a
few requests, then `--requests` more at 16 at a time (non-streamed chat, as
`loadtest/overhead.py` sends), in two runs of different lengths: the difference between the
runs' totals, divided by the difference in requests, is what a request costs, start-up and
shutdown taken out. Each run takes about a minute (callgrind runs the gateway some fifty times
slower).

    python loadtest/instructions.py
    python loadtest/instructions.py --compare ../other-checkout --requests 1000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtest.overhead import MODEL, hammer
from prefix_gateway.emulator.replicas import EmulatedReplicas
from prefix_gateway.processes import free_port

ROOT = Path(__file__).resolve().parents[1]
_TOTAL = re.compile(r"^(?:summary|totals): (\d+)", re.MULTILINE)
_WARM_UP = 100


def counted_run(checkout: Path, replica: str, requests: int) -> int:
    """Instructions the gateway of `checkout` executed from its start to its end, having
    been sent `_WARM_UP` + `requests` requests."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "callgrind.out"
        port = free_port()
        command = [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={out}",
            sys.executable,
            "-m",
            "prefix_gateway",
            "serve",
            *("--backend", replica, "--port", str(port), "--health-interval", "3600"),
            *("--log-level", "warning"),
        ]
        # The system allocator, which callgrind sees into, in place of pymalloc's arenas.
        env = {**os.environ, "GATEWAY_DOCTOR_INTERVAL": "0", "PYTHONMALLOC": "malloc"}
        process = subprocess.Popen(
            command, cwd=checkout, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 600
            while not _healthy(url):
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError(f"the gateway of {checkout} did not start under callgrind")
                time.sleep(0.5)
            asyncio.run(hammer(url, 16, _WARM_UP, False))
            asyncio.run(hammer(url, 16, requests, False))
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(600)
        found = _TOTAL.search(out.read_text())
        if found is None:
            raise RuntimeError("callgrind wrote no total")
        return int(found.group(1))


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _commit(checkout: Path) -> str:
    found = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
    )
    return found.stdout.strip() or "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000, help="requests of the longer run")
    parser.add_argument("--compare", default="", help="comma-separated checkouts to count too")
    given = parser.parse_args()
    checkouts = [ROOT, *(Path(path).resolve() for path in given.compare.split(",") if path)]
    short = max(1, given.requests // 5)
    rows = []
    with EmulatedReplicas(1, MODEL) as replicas:
        replica = replicas.urls[0]
        for checkout in checkouts:
            few = counted_run(checkout, replica, short)
            many = counted_run(checkout, replica, given.requests)
            rows.append((checkout, (many - few) / (given.requests - short)))
    print(f"\n    python loadtest/instructions.py --requests {given.requests}", end="")
    print(f" --compare {given.compare}\n" if given.compare else "\n")
    print("| gateway | commit | instructions per request |")
    print("| --- | --- | --- |")
    for checkout, per_request in rows:
        print(f"| {checkout.name} | {_commit(checkout)} | {per_request:,.0f} |")


if __name__ == "__main__":
    main()
