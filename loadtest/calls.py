"""What the request path calls, per request, counted by Python's deterministic profiler: every
function with its calls per request, grouped by module, and the modules of the features that are
switched off by default (tenants, flow control, LoRA adapters, Redis, KV events, routing by the
learned time to first token), each of which should be called no time at all.

The gateway runs under cProfile in front of one emulated replica without delay, twice: sent
`--requests` / 4 requests, then `--requests`; the difference between the two profiles, divided by
the difference in requests, is what a request calls, start-up and shutdown taken out. Times
under the profiler are inflated by its own cost per call; read them as shares, and the counts as
exact.

    python loadtest/calls.py
    python loadtest/calls.py --stream --requests 4000 --top 60
    python loadtest/calls.py -- --config tenants.yaml   # arguments after -- go to the gateway
"""

from __future__ import annotations

import argparse
import asyncio
import pstats
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtest.overhead import MODEL, hammer
from loadtest.under_tool import gateway_under
from prefix_gateway.emulator.process import EmulatorProcess

ROOT = Path(__file__).resolve().parents[1]
_WARM_UP = 200

SWITCHED_OFF = {
    "tenants": ("prefix_gateway/tenants/", "prefix_gateway/proxy/tenancy.py",
                "prefix_gateway/metrics/tenants.py"),
    "flow control": ("prefix_gateway/proxy/flow.py",),
    "LoRA adapters": ("prefix_gateway/backends/adapters.py", "prefix_gateway/metrics/adapters.py"),
    "Redis": ("prefix_gateway/state/redis/",),
    "KV events": ("prefix_gateway/backends/kv_events.py", "prefix_gateway/state/engine_blocks.py"),
    "time to first token routing": ("prefix_gateway/routing/first_token.py",
                                    "prefix_gateway/metrics/first_token.py"),
}  # fmt: skip
"""Each feature off by default, and the files only it runs."""


@dataclass(frozen=True)
class Call:
    where: str
    """file:line name, the file relative to the checkout or its package folder."""
    calls: float
    """Per request."""
    own_us: float
    """Profiled microseconds per request in the function itself."""


def profiled_run(replica: str, requests: int, stream: bool, extra: list[str]) -> pstats.Stats:
    """The gateway's profile from its start to its end, having been sent `_WARM_UP` +
    `requests` requests."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "gateway.prof"
        tool = (sys.executable, "-m", "cProfile", "-o", str(out))
        with gateway_under(tool, ROOT, replica, *extra) as url:
            asyncio.run(hammer(url, 16, _WARM_UP + requests, stream))
        return pstats.Stats(str(out))


def per_request(few: pstats.Stats, many: pstats.Stats, requests: int) -> list[Call]:
    """What `many` called beyond `few`, per each of `requests` more requests."""
    before = few.stats  # type: ignore[attr-defined]
    found = []
    for key, (_, calls, own, _, _) in many.stats.items():  # type: ignore[attr-defined]
        _, less, less_own, _, _ = before.get(key, (0, 0, 0.0, 0.0, None))
        count = (calls - less) / requests
        if count >= 0.05:
            found.append(Call(_where(*key), count, (own - less_own) / requests * 1e6))
    return sorted(found, key=lambda call: -call.calls)


def _where(file: str, line: int, name: str) -> str:
    folders = sorted((path + "/" for path in sys.path if path), key=len, reverse=True)
    for folder in (*folders, str(ROOT) + "/"):
        if file.startswith(folder):
            file = file[len(folder) :]
            break
    return f"{file}:{line} {name}"


def module_of(where: str) -> str:
    file = where.split(":", 1)[0]
    if file.startswith("~"):
        return "(built-in)"
    if file.startswith("prefix_gateway/"):
        return file
    return file.split("/", 1)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--top", type=int, default=40, help="functions listed, most calls first")
    parser.add_argument("gateway_args", nargs="*", help="after --: more arguments to the gateway")
    given = parser.parse_args()
    short = given.requests // 4
    with EmulatorProcess("--max-running", "1024", name=MODEL) as replica:
        few = profiled_run(replica.url, short, given.stream, given.gateway_args)
        many = profiled_run(replica.url, given.requests, given.stream, given.gateway_args)
    calls = per_request(few, many, given.requests - short)
    kind = "streamed" if given.stream else "non-streamed"
    command = " ".join(["python loadtest/calls.py", *sys.argv[1:]])
    print(f"\n    {command}\n\n## Per {kind} request\n")
    print(f"{sum(call.calls for call in calls):,.0f} calls of {len(calls)} functions\n")
    modules: defaultdict[str, float] = defaultdict(float)
    shares: defaultdict[str, float] = defaultdict(float)
    for call in calls:
        modules[module_of(call.where)] += call.calls
        shares[module_of(call.where)] += call.own_us
    total = sum(shares.values()) or 1.0
    print("| module | calls | share of profiled time |\n| --- | --- | --- |")
    for module, count in sorted(modules.items(), key=lambda item: -item[1]):
        if count >= 0.5:
            print(f"| {module} | {count:.1f} | {shares[module] / total:.1%} |")
    print("\n| function | calls | profiled µs |\n| --- | --- | --- |")
    for call in calls[: given.top]:
        print(f"| {call.where} | {call.calls:.2f} | {call.own_us:.1f} |")
    print("\n## Switched off\n\n| feature | functions called | calls |\n| --- | --- | --- |")
    for feature, files in SWITCHED_OFF.items():
        used = [call for call in calls if call.where.startswith(files)]
        made = sum((call.calls for call in used), 0.0)
        names = ", ".join(call.where for call in used[:3]) or "none"
        print(f"| {feature} | {names} | {made:.2f} |")


if __name__ == "__main__":
    main()
