from __future__ import annotations

import os
import re
from collections.abc import Generator, Iterator

import openai
import pytest

from prefix_gateway.emulator.replicas import EmulatedReplicas
from prefix_gateway.processes import ChildProcess
from tests.support import GatewayProcess

MODEL = "emulated-model"
SKIP_REAL_VLLM = "SKIP_REAL_VLLM"
SKIP_REAL_VLLM_REASON = f"--skip-real-vllm or {SKIP_REAL_VLLM}=1"
# On CI (`CI=true`) a skip fails its test unless its reason is one of these: what was asked
# for, or what this platform cannot do. A tool missing on CI is a gap to close, not a pass.
ALLOWED_SKIPS_ON_CI = (SKIP_REAL_VLLM_REASON, "reads /proc")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--skip-real-vllm",
        action="store_true",
        help=f"skip the real_vllm tests (also: {SKIP_REAL_VLLM}=1); by default they run",
    )


# The error records of the processes that ended since the last test's teardown was checked.
_UNEXPECTED_ERRORS: list[tuple[str, str]] = []


def _witness(process: ChildProcess) -> None:
    """Read a process's log when it ends, before a `with` block closes it."""
    name = f"{process.module} {' '.join(process.args)}"
    _UNEXPECTED_ERRORS.extend((name, record) for record in process.unexpected_errors())


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "expect_log(pattern, ...): error records matching a regular expression that the "
        "processes ending during this test may log (the test provokes them)",
    )
    ChildProcess.on_stop = _witness


def pytest_unconfigure(config: pytest.Config) -> None:
    ChildProcess.on_stop = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    """Every process a test started is a witness: once the test's fixtures are torn down (the
    module's last test also stops the module's processes), an error one of them logged that
    the test did not expect fails the test."""
    try:
        yield
    finally:
        found, _UNEXPECTED_ERRORS[:] = list(_UNEXPECTED_ERRORS), []
        allowed = [
            re.compile(pattern)
            for mark in item.iter_markers("expect_log")
            for pattern in mark.args
        ]
        found = [
            (name, record)
            for name, record in found
            if not any(pattern.search(record) for pattern in allowed)
        ]
        if found:
            raise AssertionError(
                "a process the test started logged an error nobody expected:\n"
                + "\n".join(f"--- {name}\n{record}" for name, record in found)
            )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the tests against real vLLM replicas only when asked to."""
    asked = config.getoption("--skip-real-vllm") or os.environ.get(SKIP_REAL_VLLM) == "1"
    if not asked:
        return
    skip = pytest.mark.skip(reason=SKIP_REAL_VLLM_REASON)
    for item in items:
        if "real_vllm" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """On CI, a test skipped for a reason not in `ALLOWED_SKIPS_ON_CI` fails."""
    report = yield
    if not report.skipped or hasattr(report, "wasxfail") or os.environ.get("CI") != "true":
        return report
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if not any(allowed in reason for allowed in ALLOWED_SKIPS_ON_CI):
        report.outcome = "failed"
        report.longrepr = f"skipped on CI, which can run it: {reason}"
    return report


@pytest.fixture(scope="module")
def fleet() -> Iterator[EmulatedReplicas]:
    with EmulatedReplicas(4, MODEL, ["--chat-template", "plain"]) as started:
        yield started


@pytest.fixture(scope="module")
def gateway(fleet: EmulatedReplicas) -> Iterator[GatewayProcess]:
    with GatewayProcess(fleet.urls) as started:
        yield started


@pytest.fixture
def client(gateway: GatewayProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0) as api:
        yield api
