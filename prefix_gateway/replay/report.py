"""What a replay run measured, and the Markdown table it prints (columns: docs/replay.md)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prefix_gateway.replay.simulator import ORACLE, RunResult, Served

WINDOW_SECONDS = 60.0


@dataclass(frozen=True)
class ShapeSummary:
    shape: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    per_replica: tuple[int, ...]
    """Requests each replica served, in the replicas' order."""
    ttft_p99: float

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class Summary:
    policy: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    max_mean: float
    worst_window_max_mean: float
    ttft_p50: float
    ttft_p99: float
    over_bound: int
    routes: dict[str, int]
    shapes: tuple[ShapeSummary, ...] = ()
    adapters: int = 0
    """LoRA adapters the requests named (0: all for the base model)."""
    swaps: int = 0
    """Requests whose adapter evicted another from its replica's slots."""
    replicas_per_adapter: float = 0.0
    """Replicas that served each adapter, on average."""

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def summarise(result: RunResult) -> Summary:
    served = result.served
    ttfts = sorted(item.ttft for item in served)
    routes = Counter(item.route.value for item in served)
    return Summary(
        policy=result.policy,
        requests=len(served),
        prompt_tokens=sum(item.prompt_tokens for item in served),
        cached_tokens=sum(item.cached_tokens for item in served),
        max_mean=_max_mean(served, result.replicas),
        worst_window_max_mean=max(
            (_max_mean(window, result.replicas) for window in _windows(served)), default=0.0
        ),
        ttft_p50=_percentile(ttfts, 0.50),
        ttft_p99=_percentile(ttfts, 0.99),
        over_bound=sum(1 for item in served if item.load > item.bound),
        routes=dict(sorted(routes.items(), key=lambda pair: (-pair[1], pair[0]))),
        shapes=_by_shape(served, result.replicas),
        **_adapters(served),
    )


def _adapters(served: Sequence[Served]) -> dict[str, Any]:
    homes: dict[str, set[str]] = {}
    for item in served:
        if item.adapter:
            homes.setdefault(item.adapter, set()).add(item.backend)
    if not homes:
        return {}
    return {
        "adapters": len(homes),
        "swaps": sum(1 for item in served if item.swapped),
        "replicas_per_adapter": sum(len(backends) for backends in homes.values()) / len(homes),
    }


def _by_shape(served: Sequence[Served], replicas: Sequence[str]) -> tuple[ShapeSummary, ...]:
    shapes = sorted({item.shape for item in served if item.shape})
    summaries = []
    for shape in shapes:
        mine = [item for item in served if item.shape == shape]
        counts = Counter(item.backend for item in mine)
        summaries.append(
            ShapeSummary(
                shape=shape,
                requests=len(mine),
                prompt_tokens=sum(item.prompt_tokens for item in mine),
                cached_tokens=sum(item.cached_tokens for item in mine),
                per_replica=tuple(counts.get(name, 0) for name in replicas),
                ttft_p99=_percentile(sorted(item.ttft for item in mine), 0.99),
            )
        )
    return tuple(summaries)


def render_table(title: str, summaries: Sequence[Summary]) -> str:
    """A Markdown table, one row per policy; the same summaries always give the same text."""
    oracle = next((item for item in summaries if item.policy == ORACLE), None)
    lines = [
        title,
        "",
        "| policy | hit rate | of oracle | prefilled tokens | max/mean req | worst minute "
        "| TTFT p50 ms | TTFT p99 ms | over bound | routes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for item in summaries:
        share = f"{item.hit_rate / oracle.hit_rate:.0%}" if oracle and oracle.hit_rate else "-"
        routes = ", ".join(f"{name} {count}" for name, count in item.routes.items())
        lines.append(
            f"| {item.policy} | {item.hit_rate:.1%} | {share} "
            f"| {item.prompt_tokens - item.cached_tokens:,} | {item.max_mean:.2f} "
            f"| {item.worst_window_max_mean:.2f} | {item.ttft_p50 * 1000:,.1f} "
            f"| {item.ttft_p99 * 1000:,.1f} | {item.over_bound} | {routes} |"
        )
    if any(len(item.shapes) > 1 for item in summaries):
        lines += [
            "",
            "| policy | shape | requests | hit rate | prefilled tokens | TTFT p99 ms "
            "| requests per replica |",
            "|---|---|---:|---:|---:|---:|---|",
        ]
        for item in summaries:
            for shape in item.shapes:
                per_replica = " / ".join(str(count) for count in shape.per_replica)
                lines.append(
                    f"| {item.policy} | {shape.shape} | {shape.requests:,} "
                    f"| {shape.hit_rate:.1%} | {shape.prompt_tokens - shape.cached_tokens:,} "
                    f"| {shape.ttft_p99 * 1000:,.1f} | {per_replica} |"
                )
    if any(item.adapters for item in summaries):
        lines += [
            "",
            "| policy | LoRA adapters | swaps | replicas per adapter |",
            "|---|---:|---:|---:|",
        ]
        lines += [
            f"| {item.policy} | {item.adapters} | {item.swaps:,} "
            f"| {item.replicas_per_adapter:.2f} |"
            for item in summaries
        ]
    return "\n".join(lines)


def _max_mean(served: Sequence[Served], replicas: Sequence[str]) -> float:
    if not served:
        return 0.0
    counts = Counter(item.backend for item in served)
    mean = len(served) / len(replicas)
    return max(counts.get(name, 0) for name in replicas) / mean


def _windows(served: Sequence[Served]) -> list[list[Served]]:
    if not served:
        return []
    last = max(item.arrival for item in served)
    whole = int(last // WINDOW_SECONDS)
    if whole == 0:
        return [list(served)]
    windows: list[list[Served]] = [[] for _ in range(whole)]
    for item in served:
        number = int(item.arrival // WINDOW_SECONDS)
        if number < whole:
            windows[number].append(item)
    return [window for window in windows if window]


def _percentile(ordered: Sequence[float], share: float) -> float:
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]
