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
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtest.overhead import MODEL, hammer
from loadtest.under_tool import gateway_under
from prefix_gateway.emulator.replicas import EmulatedReplicas

ROOT = Path(__file__).resolve().parents[1]
_TOTAL = re.compile(r"^(?:summary|totals): (\d+)", re.MULTILINE)
_WARM_UP = 100


def counted_run(checkout: Path, replica: str, requests: int) -> int:
    """Instructions the gateway of `checkout` executed from its start to its end, having
    been sent `_WARM_UP` + `requests` requests."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "callgrind.out"
        tool = ("valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable)
        # The system allocator, which callgrind sees into, in place of pymalloc's arenas.
        env = {"PYTHONMALLOC": "malloc"}
        with gateway_under(tool, checkout, replica, env=env, patience=600) as url:
            asyncio.run(hammer(url, 16, _WARM_UP, False))
            asyncio.run(hammer(url, 16, requests, False))
        found = _TOTAL.search(out.read_text())
        if found is None:
            raise RuntimeError("callgrind wrote no total")
        return int(found.group(1))


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
