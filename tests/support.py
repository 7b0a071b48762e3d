"""Real processes for integration tests: the gateway on a free loopback port."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from gateway.processes import ChildProcess, free_port, metric_value

__all__ = ["GatewayProcess", "free_port", "metric_value", "run_script"]

ROOT = Path(__file__).resolve().parent.parent


def run_script(script: str, *args: str, timeout: float = 180) -> str:
    """What `python SCRIPT ARGS` prints, run from the checkout; fails the test if it failed."""
    result = subprocess.run(
        [sys.executable, script, *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


class GatewayProcess(ChildProcess):
    def __init__(
        self,
        backends: Sequence[str],
        *args: str,
        env: dict[str, str] | None = None,
        checkout: str | None = None,
        startup_seconds: float = 20.0,
    ):
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
            cwd=checkout,
            startup_seconds=startup_seconds,
        )

    def metrics(self) -> str:
        return self.metrics_text()
