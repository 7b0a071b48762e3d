"""Real processes for integration tests: the gateway on a free loopback port."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.child import ChildProcess, free_port

__all__ = ["GatewayProcess", "free_port", "metric_value"]


class GatewayProcess(ChildProcess):
    def __init__(self, backends: Sequence[str], *args: str, env: dict[str, str] | None = None):
        super().__init__(
            "gateway",
            (
                "serve",
                "--health-interval",
                "0.5",
                "--log-level",
                "warning",
                *(part for backend in backends for part in ("--backend", backend)),
                *args,
            ),
            env=env,
        )

    def metrics(self) -> str:
        return self.metrics_text()


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        if series.split("{")[0] != name:
            continue
        if all(f'{key}="{wanted}"' in series for key, wanted in labels.items()):
            total += float(value)
    return total
