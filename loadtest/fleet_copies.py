"""Which decisions of a fleet put a shared prompt on one more replica, and what each was shown.

The gateways log every decision with a shared prompt at DEBUG (`prefix_gateway.routing.
decisions`). Over all of them, in time order per prompt, a decision that sends the prompt to a
replica none of its earlier decisions chose is a *new copy*; it is printed with its gateway,
route, the milliseconds since the prompt's previous decision, and its inputs: the holders the
index (or a claim) showed, the loads, the recent counts against the hot and busy caps
(`max(1.1 m, m + 2)`, `max(1.25 m, m + 2)` at the defaults), the pending prefill. The summary
classifies each copy by the first reason the rules give for leaving the earlier replicas.
"""

from __future__ import annotations

import ast
from collections import Counter
from collections.abc import Sequence
from typing import Any

_MARK = "decision {"


def decisions(logs: Sequence[str]) -> list[dict[str, Any]]:
    """Every counted decision in the gateways' logs, with its gateway's number."""
    found = []
    for number, text in enumerate(logs):
        for line in text.splitlines():
            at = line.find(_MARK)
            if at < 0:
                continue
            record = ast.literal_eval(line[at + len(_MARK) - 1 :])
            if record["count"]:
                record["gateway"] = number
                found.append(record)
    return sorted(found, key=lambda record: record["t"])


def reason(record: dict[str, Any], earlier: set[str]) -> str:
    """Why the rules left every earlier replica, as far as the logged inputs tell."""
    shown = {name for name, depth in record["matched"].items() if depth > 0} & earlier
    if not shown:
        return "earlier replica not shown (index nor claim)"
    recent = record["recent"]
    mean = sum(recent.values()) / max(1, len(recent))
    busy, hot = max(1.25 * mean, mean + 2), max(1.1 * mean, mean + 2)
    if all(recent.get(name, 0.0) > hot for name in shown):
        return "holders above the hot cap"
    if all(recent.get(name, 0.0) > busy for name in shown):
        return "holders above the busy cap"
    if all(record["loads"].get(name, 0) + 1 > record["bound"] for name in shown):
        return "holders past the load bound"
    return "other (owner margin, share)"


def print_copies(logs: Sequence[str]) -> None:
    last: dict[int, float] = {}
    chosen: dict[int, set[str]] = {}
    reasons: Counter[str] = Counter()
    for record in decisions(logs):
        prompt = record["prompt"]
        earlier = chosen.setdefault(prompt, set())
        if earlier and record["backend"] not in earlier:
            why = reason(record, earlier)
            reasons[f"{record['route']}: {why}"] += 1
            print(
                f"#   copy: gateway {record['gateway']} {record['route']} -> {record['backend']}"
                f" {1000 * (record['t'] - last[prompt]):.0f} ms after the previous; earlier"
                f" {sorted(earlier)}; {why}; matched {record['matched']} claimed"
                f" {record['claimed']} share {record['share']} loads {record['loads']}"
                f" bound {record['bound']} recent {record['recent']}"
                f" pending {record['pending']}"
            )
        earlier.add(record["backend"])
        last[prompt] = record["t"]
    print(
        "#   copies by route and reason: "
        + (", ".join(f"{why} {count}" for why, count in reasons.most_common()) or "none")
    )
