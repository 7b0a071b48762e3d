from __future__ import annotations

import os
import re
from collections.abc import Generator, Iterator

import openai
import pytest
from hypothesis import settings
from xdist.remote import Producer
from xdist.scheduler import LoadScopeScheduling

from prefix_gateway.emulator.replicas import EmulatedReplicas
from prefix_gateway.logwatch import Witnesses
from tests.real_fleet import RealReplicas, started_real_replicas
from tests.support import GatewayProcess

MODEL = "emulated-model"
SKIP_REAL_VLLM = "SKIP_REAL_VLLM"
SKIP_REAL_VLLM_REASON = f"--skip-real-vllm or {SKIP_REAL_VLLM}=1"
# On CI (`CI=true`) a skip fails its test: a real engine or a tool missing on CI is a gap to
# close, not a pass. Only what this platform cannot do is skipped there, unless the run is
# told `ALLOW_SKIPS=1`, and then its last line says how many were.
PLATFORM_SKIPS = ("reads /proc",)
ALLOW_SKIPS = "ALLOW_SKIPS"
# The modules that share the session's pair of real vLLM replicas (tests/real_fleet.py): one
# scope, so that one worker starts the pair once.
SHARED_PAIR_MODULES = frozenset({"test_real_vllm.py", "test_real_vllm_lora.py"})
SHARED_PAIR_SCOPE = "real-vllm-pair"

# Examples are judged by what they assert, never by how long they took on a busy machine; on
# CI the same examples every run, so that a failure there is a failure here.
settings.register_profile("default", deadline=None)
settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") == "true" else "default")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--skip-real-vllm",
        action="store_true",
        help=f"skip the real_vllm tests (also: {SKIP_REAL_VLLM}=1); by default they run",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "expect_log(pattern, ...): error records matching a regular expression that the "
        "processes logging during this test may log (the test provokes them)",
    )
    Witnesses.watching = Witnesses()


def pytest_unconfigure(config: pytest.Config) -> None:
    Witnesses.watching = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    """Every process a test started is a witness: once the test's fixtures are torn down, an
    error that one of them logged since the last test (a module's or the session's processes,
    still running, included) that the test did not expect fails the test."""
    try:
        yield
    finally:
        witnesses = Witnesses.watching
        found = witnesses.read() if witnesses is not None else []
        allowed = [
            re.compile(pattern) for mark in item.iter_markers("expect_log") for pattern in mark.args
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
    """Skip the tests against real vLLM replicas only when asked to; otherwise put them first,
    so that on several workers the one that takes them starts at once (after the `alone`
    ones, where one run selects both)."""
    asked = config.getoption("--skip-real-vllm") or os.environ.get(SKIP_REAL_VLLM) == "1"
    if asked:
        skip = pytest.mark.skip(reason=SKIP_REAL_VLLM_REASON)
        for item in items:
            if "real_vllm" in item.keywords:
                item.add_marker(skip)
        return
    # Those that learn from timing before any engine starts (an engine left running is load).
    items.sort(key=lambda item: ("alone" not in item.keywords, "real_vllm" not in item.keywords))


class ModuleScopes(LoadScopeScheduling):
    """`--dist loadscope` as this suite needs it: a worker takes a module at a time, so that
    a module's fixtures start once, and the modules sharing the real pair are one scope, so
    that one worker starts the pair while another starts the engines of its own modules."""

    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        return SHARED_PAIR_SCOPE if os.path.basename(module) in SHARED_PAIR_MODULES else module


def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> ModuleScopes | None:
    return ModuleScopes(config, log) if config.getvalue("dist") == "loadscope" else None


def on_ci() -> bool:
    return os.environ.get("CI") == "true"


def skips_allowed() -> bool:
    return os.environ.get(ALLOW_SKIPS) == "1"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """On CI, a skipped test fails unless this platform cannot run it or skips are allowed."""
    report = yield
    if not report.skipped or hasattr(report, "wasxfail") or not on_ci() or skips_allowed():
        return report
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if not any(allowed in reason for allowed in PLATFORM_SKIPS):
        report.outcome = "failed"
        report.longrepr = f"skipped on CI, which must run it ({ALLOW_SKIPS}=1 allows it): {reason}"
    return report


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """A CI run that was allowed to skip says so, and how many it skipped."""
    if on_ci() and skips_allowed():
        skipped = len(terminalreporter.stats.get("skipped", []))
        terminalreporter.write_line(
            f"{ALLOW_SKIPS}=1: {skipped} tests skipped on CI, none of them counted as failed"
        )


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


@pytest.fixture(scope="session")
def real_replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealReplicas]:
    """Two real vLLM replicas for every module that tests against them (tests/real_fleet.py)."""
    with started_real_replicas(tmp_path_factory.mktemp("real-replicas")) as started:
        yield started
