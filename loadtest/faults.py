"""Fault scenarios against real processes: what clients see when things break.

Each scenario starts its own emulated replicas (and fault servers, Redis) and a gateway on
loopback ports, puts a bounded load on it, injects its fault, and returns the tally of every
request plus the facts the gateway reported. `tests/test_faults_*.py` run the same scenarios
and assert on them; this script prints the table of docs/reliability.md:

    python loadtest/faults.py
    python loadtest/faults.py --scenarios killed,overload
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtest.fault_clients import (
    clients_disconnect,
    fuzzed_requests,
    overload,
    redis_killed,
    sigterm_during_streams,
)
from loadtest.fault_load import Result
from loadtest.fault_replicas import replica_killed, replica_stalls, replicas_misbehave

SCENARIOS: dict[str, Callable[[], Coroutine[Any, Any, Result]]] = {
    "killed": replica_killed,
    "stalls": replica_stalls,
    "misbehave": replicas_misbehave,
    "disconnect": clients_disconnect,
    "redis": redis_killed,
    "overload": overload,
    "fuzz": fuzzed_requests,
    "sigterm": sigterm_during_streams,
}


def print_table(results: list[Result]) -> None:
    print("| scenario | requests sent | faults injected | requests failed | requests lost |")
    print("|---|---|---|---|---|")
    for result in results:
        tally = result.tally
        print(
            f"| {result.scenario} | {tally.sent:,} | {result.faults} | {tally.failed:,} "
            f"| {tally.lost:,} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = parser.parse_args()
    results = []
    for name in args.scenarios.split(","):
        began = time.monotonic()
        result = asyncio.run(SCENARIOS[name]())
        facts = ", ".join(f"{key}={value:g}" for key, value in result.facts.items())
        print(f"{name}: {time.monotonic() - began:.1f} s; {facts}", file=sys.stderr)
        results.append(result)
    print_table(results)


if __name__ == "__main__":
    main()
