from __future__ import annotations

import os
from collections.abc import Iterator

import openai
import pytest

from gateway.emulator.replicas import EmulatedReplicas
from gateway.processes import ChildProcess
from tests.support import GatewayProcess

MODEL = "emulated-model"
SKIP_REAL_VLLM = "SKIP_REAL_VLLM"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--skip-real-vllm",
        action="store_true",
        help=f"skip the real_vllm tests (also: {SKIP_REAL_VLLM}=1); by default they run",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the tests against real vLLM replicas only when asked to."""
    asked = config.getoption("--skip-real-vllm") or os.environ.get(SKIP_REAL_VLLM) == "1"
    if not asked:
        return
    skip = pytest.mark.skip(reason=f"--skip-real-vllm or {SKIP_REAL_VLLM}=1")
    for item in items:
        if "real_vllm" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def fleet() -> Iterator[EmulatedReplicas]:
    with EmulatedReplicas(4, MODEL, ["--chat-template", "plain"]) as started:
        yield started
        assert_no_traceback(started)


@pytest.fixture(scope="module")
def gateway(fleet: EmulatedReplicas) -> Iterator[GatewayProcess]:
    with GatewayProcess(fleet.urls) as started:
        yield started
        assert_no_traceback(started)


def assert_no_traceback(process: ChildProcess | EmulatedReplicas) -> None:
    """Fail the test whose process logged a traceback: an error its client never saw."""
    found = process.tracebacks()
    assert not found, "a process the test started logged a traceback:\n" + "\n".join(found)


@pytest.fixture
def client(gateway: GatewayProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0) as api:
        yield api
