"""The README's commands, as a new user types them after the install step the README names:
the load tests' install, the benchmark's start, the replay beside its oracle, the Compose
command's variables, and the doctor against emulated replicas.

(The headless locust run is tests/test_locust.py's, the README's command itself.)"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

from loadtest.peers import PEERS
from prefix_gateway.routing.policies import POLICIES
from tests.readme import commands
from tests.test_replay_runs import conversation_trace

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
"""Where `make install` put the programs the README runs from `.venv/bin/` (this test's venv)."""


def in_this_venv(words: list[str]) -> list[str]:
    program = words[0].removeprefix(".venv/bin/")
    if program == "prefix-gateway":
        return [sys.executable, "-m", "prefix_gateway", *words[1:]]
    return [str(BIN / program), *words[1:]]


def run(words: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        in_this_venv(words), cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )


def requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=\[; ]", requirement, maxsplit=1)[0] for requirement in requirements}


def test_the_load_tests_follow_the_install_step_that_brings_what_they_import() -> None:
    load = commands("Load testing")
    assert load[0] == ["make", "install"]
    assert all(not words[0].startswith(".venv/bin/") for words in commands("Quick start"))
    # What `make install` does from scratch: the runtime, then the test extra.
    plan = subprocess.run(
        ["make", "-n", "-B", "install"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert "pip install --quiet -e '.[test]'" in plan
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    test_extra = requirement_names(project["optional-dependencies"]["test"])
    runtime = requirement_names(project["dependencies"])
    # `make run` installs the runtime alone: without the step, these are missing.
    assert {"locust", "aiohttp"} <= test_extra - runtime
    assert "import aiohttp" in (ROOT / "loadtest" / "benchmark.py").read_text()
    programs = {words[0] for words in load if words[0].startswith(".venv/bin/")}
    assert programs == {".venv/bin/locust", ".venv/bin/python"}


def test_the_web_ui_command_sets_a_variable_the_locustfile_reads() -> None:
    (web,) = [words for words in commands("Load testing") if words[0].startswith("LOCUST_")]
    name = web[0].partition("=")[0].removeprefix("LOCUST_")
    assert f'_setting("{name}", ' in (ROOT / "loadtest" / "locustfile.py").read_text()


def test_the_benchmark_command_starts_with_routers_it_knows() -> None:
    (benchmark,) = [words for words in commands("Load testing") if "loadtest/benchmark.py" in words]
    started = run([*benchmark, "--help"])
    assert started.returncode == 0, started.stderr
    assert "--policies" in started.stdout
    routers = benchmark[benchmark.index("--policies") + 1].split(",")
    assert set(routers) <= {*POLICIES, *PEERS}
    assert "vllm-router-cache_aware" in routers and "sglang-cache_aware" in routers


def test_replay_prints_every_policy_beside_the_oracle(tmp_path: Path) -> None:
    (replay,) = commands("What-if replay")
    trace = conversation_trace(
        tmp_path / "trace.jsonl", seed=3, conversations=8, turns=3, gap_ms=400
    )
    ended = run([str(trace) if word == "TRACE.jsonl" else word for word in replay])
    assert ended.returncode == 0, ended.stderr
    rows = [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in ended.stdout.splitlines()
        if line.startswith("| ") and not line.startswith("| policy")
    ]
    named = [replay[position + 1] for position, word in enumerate(replay) if word == "--policy"]
    assert [row[0] for row in rows] == [*named, "oracle"]
    assert rows[-1][2] == "100%"
    for row in rows:
        assert re.fullmatch(r"\d+%", row[2]), row  # "of oracle": never "-"
