"""`--forward-priority` against real vLLM: a replica of the tiny model run with
`--scheduling-policy priority` and one sequence at a time (`--max-num-seqs 1`), so that every
request but the running one waits in the engine's queue, and gateways with two tenants in front.

The order is made by the engine, not by timing: a long stream holds the one running slot while
the others queue (seen in the replica's `vllm:num_requests_waiting`); when it is closed, the
engine picks the next, which then holds the slot until the test closes it in turn. No request
can begin while another runs, so the order of first tokens is the engine's order.

The tiny model can decode the holder's whole answer before both others have queued (a busy
machine delays them). That attempt then decides nothing: it is noticed (the holder ended by
itself before the engine had two waiting), wound down and made again.

Marker `real_vllm` (skipped with `--skip-real-vllm`); the replica is this module's own.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from engines.fleet import model_folder
from engines.replica import VLLMReplica
from engines.tiny_model import ensure_model
from engines.venv import VLLMVenv
from tests.support import GatewayProcess, wait_until

pytestmark = pytest.mark.real_vllm

MODEL = "tiny-llama"
TENANTS = [
    {"name": "interactive", "api_key": "interactive-key", "priority": 2},
    {"name": "batch", "api_key": "batch-key"},
]
# As long as the engine's context allows: a stream runs until the test closes it, or, on a
# machine slow to send the others, ends by itself (an attempt made again).
LONG = 4000
ENGINE_PATIENCE = 120.0
ATTEMPTS = 4
# The engine holds the queued requests by design, for longer than a stall on a busy machine
# (where it may also produce nothing, or answer /health slowly, for seconds): neither is
# evidence against it here.
NOT_STALLS = ("--stall-seconds", "3600", "--health-timeout", "10", "--unhealthy-threshold", "5")


@pytest.fixture(scope="module")
def replica() -> Iterator[VLLMReplica]:
    venv = VLLMVenv().ensure()
    model = ensure_model(venv.python, model_folder())
    policy = ("--scheduling-policy", "priority", "--max-num-seqs", "1")
    with VLLMReplica(
        model, venv=venv, served_model_names=(MODEL,), cpu_cores="0", extra_args=policy
    ) as started:
        yield started


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("priority") / "gateway.yaml"
    path.write_text(yaml.safe_dump({"tenants": TENANTS}))
    return path


@pytest.fixture(scope="module")
def prioritised(replica: VLLMReplica, config: Path) -> Iterator[GatewayProcess]:
    args = ("--config", str(config), "--forward-priority")
    with GatewayProcess([replica.url], *args, *NOT_STALLS) as started:
        yield started


class Stream:
    """A streamed chat completion through a gateway, read on a thread of its own until it is
    closed: its first token is appended to `order` as its tag."""

    def __init__(
        self, gateway: GatewayProcess, key: str, tag: str, order: list[str], **extra: Any
    ) -> None:
        self.status = 0
        self.ended = False  # the answer ended by itself, before the test closed it
        self._body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"request {tag}: tell me everything"}],
            "max_tokens": LONG,
            "ignore_eos": True,
            "stream": True,
            **extra,
        }
        self._url = gateway.url + "/v1/chat/completions"
        self._headers = {"authorization": f"Bearer {key}"}
        self._tag, self._order = tag, order
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._read, name=f"stream-{tag}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Hang up: the gateway aborts the request at the engine, which frees its slot."""
        self._closing.set()
        self._thread.join(ENGINE_PATIENCE)
        assert not self._thread.is_alive(), f"stream {self._tag} did not end"

    def _read(self) -> None:
        with (
            httpx.Client(timeout=ENGINE_PATIENCE) as http,
            http.stream("POST", self._url, json=self._body, headers=self._headers) as reply,
        ):
            self.status = reply.status_code
            for line in reply.iter_lines():
                if line.startswith("data: {") and self._tag not in self._order:
                    self._order.append(self._tag)
                if self._closing.is_set():
                    return
        self.ended = True


def queued(replica: VLLMReplica, waiting: int, running: int = 1) -> bool:
    """Whether the engine runs `running` requests and has `waiting` in its queue."""
    return (
        replica.metric("vllm:num_requests_running") == running
        and replica.metric("vllm:num_requests_waiting") == waiting
    )


def served_order(gateway: GatewayProcess, replica: VLLMReplica, **batch_extra: Any) -> list[str]:
    """Which of two queued requests the engine serves first: `batch` queued before
    `interactive`, both behind a running request that is then closed."""
    for _ in range(ATTEMPTS):
        order = attempt_order(gateway, replica, **batch_extra)
        if order is not None:
            return order
    raise AssertionError(f"the holder ended before two requests queued, {ATTEMPTS} times")


def attempt_order(
    gateway: GatewayProcess, replica: VLLMReplica, **batch_extra: Any
) -> list[str] | None:
    """The order of first tokens, or None when the holder ended before both others waited."""
    order: list[str] = []
    holder = Stream(gateway, "batch-key", "holder", order)
    wait_until(lambda: "holder" in order, "the holder's first token", ENGINE_PATIENCE)
    batch = Stream(gateway, "batch-key", "batch", order, **batch_extra)
    wait_until(
        lambda: queued(replica, 1) or holder.ended, "batch waiting in the engine", ENGINE_PATIENCE
    )
    interactive = Stream(gateway, "interactive-key", "interactive", order)
    wait_until(
        lambda: queued(replica, 2) or holder.ended, "both waiting in the engine", ENGINE_PATIENCE
    )
    # Once both have been seen waiting the engine's choice is made; until then it is not.
    decided = queued(replica, 2)
    streams = [holder]
    if decided:
        holder.close()
        wait_until(lambda: len(order) == 2, "the next request's first token", ENGINE_PATIENCE)
        first, second = (batch, interactive) if order[1] == "batch" else (interactive, batch)
        streams += [first]
        first.close()
        wait_until(lambda: len(order) == 3, "the last request's first token", ENGINE_PATIENCE)
        streams += [second]
    else:
        streams += [batch, interactive]
    for stream in streams:
        stream.close()
    assert [holder.status, batch.status, interactive.status] == [200, 200, 200]
    wait_until(lambda: queued(replica, 0, running=0), "the engine idle", ENGINE_PATIENCE)
    return order if decided else None


def test_the_higher_priority_tenant_is_served_before_one_queued_earlier(
    prioritised: GatewayProcess, replica: VLLMReplica
) -> None:
    # The batch client asks for the front of the queue itself; the gateway sends its tenant's 0.
    order = served_order(prioritised, replica, priority=-1000)
    assert order == ["holder", "interactive", "batch"]


def test_without_the_flag_the_engine_serves_them_as_they_came(
    replica: VLLMReplica, config: Path
) -> None:
    with GatewayProcess([replica.url], "--config", str(config), *NOT_STALLS) as plain:
        assert served_order(plain, replica) == ["holder", "batch", "interactive"]


def test_the_engine_takes_the_rewritten_priority_on_every_generating_endpoint(
    prioritised: GatewayProcess, replica: VLLMReplica
) -> None:
    # vLLM refuses a priority that is not an integer; through the gateway the tenant's replaces it.
    bad = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "priority": "high"}
    refused = httpx.post(replica.url + "/v1/completions", json=bad, timeout=ENGINE_PATIENCE)
    assert refused.status_code == 400 and "priority" in refused.text
    with openai.OpenAI(
        base_url=prioritised.url + "/v1", api_key="interactive-key", max_retries=0, timeout=120
    ) as client:
        completion = client.completions.create(
            model=MODEL,
            prompt="hello",
            max_tokens=2,
            extra_body={"priority": "high", "ignore_eos": True},
        )
        assert completion.usage is not None and completion.usage.completion_tokens == 2
        chat = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=2,
            extra_body={"priority": "high", "ignore_eos": True},
        )
        assert chat.usage is not None and chat.usage.completion_tokens == 2
        response = client.responses.create(
            model=MODEL, input="hello", max_output_tokens=2, extra_body={"priority": "high"}
        )
        assert response.usage is not None and response.usage.output_tokens >= 1
