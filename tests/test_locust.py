"""A short headless locust run of loadtest/locustfile.py through a real gateway: the README's
command, for eight seconds and against this test's gateway.

Four emulated replicas (as the README's `make run`), one gateway, eight users: the cache hit
rate locust reports comes from the `usage` of real responses, and agrees with what the gateway
observed.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefix_gateway.emulator.replicas import EmulatedReplicas
from tests.readme import commands
from tests.support import GatewayProcess

ROOT = Path(__file__).resolve().parent.parent
LOCUST = Path(sys.executable).parent / "locust"
_ROW = re.compile(r"^(?P<shape>\w+)\s+(?P<requests>\d+)\s+(?P<prompt>\d+)\s+(?P<cached>\d+)\s+")


@pytest.fixture(scope="module")
def gateway() -> Iterator[GatewayProcess]:
    with (
        EmulatedReplicas(4, "emulated-model") as fleet,
        GatewayProcess(fleet.urls) as started,
    ):
        yield started


def cache_table(output: str) -> dict[str, tuple[int, int, int]]:
    lines = output.splitlines()
    start = lines.index("cache hits (usage.prompt_tokens_details.cached_tokens)")
    rows = {}
    for line in lines[start + 2 :]:
        match = _ROW.match(line)
        if match is None:
            break
        rows[match["shape"]] = (int(match["requests"]), int(match["prompt"]), int(match["cached"]))
    return rows


def readme_headless_run(host: str) -> list[str]:
    """The README's headless command, as typed, for a gateway at `host` and for 8 s, not 20."""
    (words,) = [words for words in commands("Load testing") if "--headless" in words]
    assert words[0] == ".venv/bin/locust" and words[words.index("-t") + 1] == "20s"
    words = [str(LOCUST), *words[1:]]
    words[words.index("--host") + 1] = host
    words[words.index("-t") + 1] = "8s"
    return words


@pytest.mark.slow
def test_headless_run_reports_a_hit_rate_read_from_responses(gateway: GatewayProcess) -> None:
    assert LOCUST.exists(), "locust is in the test extra"
    result = subprocess.run(
        readme_headless_run(gateway.url),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]  # locust exits 1 on any failure
    rows = cache_table(result.stdout)
    assert {"shared", "conversation", "rag", "all"} <= set(rows), result.stdout
    requests, prompt_tokens, cached_tokens = rows["all"]
    assert requests >= 30 and prompt_tokens > 0
    assert cached_tokens > 0, "no cache hit reported by any response"
    # Shared prompts and conversations reuse far more than retrieval in varying order does.
    for shape in ("shared", "conversation"):
        shape_requests, shape_prompt, shape_cached = rows[shape]
        assert shape_requests > 0 and shape_cached / shape_prompt > 0.5, rows
    aggregated = (result.stdout + result.stderr).split("Aggregated")[1].splitlines()[0]
    assert " 0(0.00%)" in aggregated, "locust counted failed requests"
    # What locust read is what the replicas reported through the gateway (which may also have
    # counted a response whose client was stopped before reading it).
    observed = gateway.metric("gateway_upstream_cached_tokens_total")
    assert cached_tokens <= observed <= cached_tokens * 1.2
