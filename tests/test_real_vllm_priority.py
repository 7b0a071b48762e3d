"""`--forward-priority` against real vLLM: a replica of the tiny model run with
`--scheduling-policy priority` and one sequence at a time (`--max-num-seqs 1`), so that every
request but the running one waits in the engine's queue, and gateways with two tenants in front.

The order is made by the engine, not by timing: a long request holds the one running slot while
two others queue (seen in the replica's `vllm:num_requests_waiting`); when the holder is
closed, the engine picks the next. The queued requests are as long as the holder and run until
the test closes them, so the one picked streams while the other still waits: the first, and
until it is closed the only one, to receive a token is the engine's choice, however late the
test's threads read their sockets.

The holder is not streamed: a streamed answer keeps vLLM's API server formatting a chunk per
token, and on a busy machine its `/metrics` then answered only when the stream was over, so the
queue could not be seen (the queued requests are streamed, but once one of them runs the test
reads only its sockets). Its context is longer than the model's own (RoPE runs past it), so the
engine decodes it for a minute or more. Should the holder still end before both others queued
(a starved machine), that attempt decides nothing: it is noticed, wound down and made again.

Marker `real_vllm` (skipped with `--skip-real-vllm`); the replica is this module's own.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from engines.fleet import model_folder
from engines.replica import MIB, VLLMReplica
from engines.tiny_model import ensure_model
from engines.venv import VLLMVenv
from tests.support import GatewayProcess, wait_until

# An attempt may wait up to ENGINE_PATIENCE more than once on a starved machine.
pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(1800)]

MODEL = "tiny-llama"
TENANTS: list[dict[str, Any]] = [
    {"name": "interactive", "api_key": "interactive-key", "priority": 2},
    {"name": "batch", "api_key": "batch-key"},
]
CONTEXT = 16384
# As long as the engine's context allows: a request runs until the test closes it, or, on a
# machine slow to send the others, ends by itself (an attempt made again).
LONG = CONTEXT - 100
# The engine takes this long to notice a hang-up while it decodes on a busy machine.
ENGINE_PATIENCE = 300.0
ATTEMPTS = 4
# The engine holds the queued requests by design, for longer than a stall on a busy machine
# (where it may also produce nothing, or answer /health and accept connections slowly, for
# seconds): none of it is evidence against it here.
NOT_STALLS = (
    "--stall-seconds",
    "3600",
    "--health-timeout",
    "30",
    "--unhealthy-threshold",
    "10",
    "--connect-timeout",
    "30",
)


@pytest.fixture(scope="module")
def replica() -> Iterator[VLLMReplica]:
    venv = VLLMVenv().ensure()
    model = ensure_model(venv.python, model_folder())
    policy = ("--scheduling-policy", "priority", "--max-num-seqs", "1")
    with VLLMReplica(
        model,
        venv=venv,
        served_model_names=(MODEL,),
        cpu_cores="0",
        max_model_len=CONTEXT,
        kv_cache_bytes=128 * MIB,
        env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"},
        extra_args=policy,
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


def chat(tag: str, max_tokens: int, *, stream: bool, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"request {tag}: tell me everything"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
        **extra,
    }


class Held:
    """A long chat completion through a gateway on a socket of the test's own, read on a thread
    of its own, so that the test can hang up while the engine is still decoding it. Streamed,
    its tag is appended to `order` when its first token arrives."""

    def __init__(
        self,
        gateway: GatewayProcess,
        key: str,
        tag: str,
        *,
        stream: bool,
        order: list[str] | None = None,
        **extra: Any,
    ) -> None:
        self.status = 0  # known once the head of the answer came
        self.ended = False
        self._tag, self._order = tag, order
        host, port = gateway.host, gateway.port
        body = json.dumps(chat(tag, LONG, stream=stream, **extra)).encode()
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\n"
            f"host: {host}:{port}\r\nauthorization: Bearer {key}\r\n"
            "content-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        )
        self._socket = socket.create_connection((host, port))
        self._socket.sendall(head.encode() + body)
        self._socket.settimeout(0.2)
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._read, name=tag, daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Hang up: the gateway aborts the request at the engine, which frees its slot."""
        self._closing.set()
        self._thread.join(ENGINE_PATIENCE)
        assert not self._thread.is_alive(), f"request {self._tag} did not end"

    def _read(self) -> None:
        received = b""
        with self._socket:
            while not self._closing.is_set():
                try:
                    chunk = self._socket.recv(65536)
                except TimeoutError:
                    continue
                if not chunk:
                    self.ended = True
                    return
                received += chunk
                if not self.status and b"\r\n" in received:
                    self.status = int(received.split(b" ", 2)[1])
                order = self._order
                if order is not None and self._tag not in order and b"data: {" in received:
                    order.append(self._tag)


def queued(replica: VLLMReplica, waiting: int, running: int = 1) -> bool:
    """Whether the engine runs `running` requests and has `waiting` in its queue."""
    return (
        replica.metric("vllm:num_requests_running") == running
        and replica.metric("vllm:num_requests_waiting") == waiting
    )


def health_seen_by(gateway: GatewayProcess, replica: VLLMReplica) -> str:
    """What the gateway saw of its replica (health, ejections, upstream errors and retries, its
    last warnings) and the end of the replica's log, for a failure's message."""
    kept = ("healthy", "eject", "stall", "probe", "upstream_errors", "upstream_retries")
    series = [
        line
        for line in gateway.metrics_text().splitlines()
        if not line.startswith("#") and any(k in line for k in kept)
    ]
    warnings = [line for line in gateway.log().splitlines() if "WARNING" in line]
    return "\n".join([*series, *warnings[-20:], replica.log_tail(3000)])


def warm_up(gateway: GatewayProcess) -> None:
    """A short answer of each kind for each tenant: a first request's setup (seen to take as
    long as the holder in front of a busy engine) falls outside the attempts."""
    for stream in (False, True):
        for key in ("batch-key", "interactive-key"):
            answer = httpx.post(
                gateway.url + "/v1/chat/completions",
                json=chat("warm-up", 4, stream=stream),
                headers={"authorization": f"Bearer {key}"},
                timeout=ENGINE_PATIENCE,
            )
            assert answer.status_code == 200, answer.text


def served_first(
    gateway: GatewayProcess,
    replica: VLLMReplica,
    interactive_extra: dict[str, Any] | None = None,
    **batch_extra: Any,
) -> str:
    """Which of two queued requests the engine serves first: `batch` queued before
    `interactive`, both behind a running request that is then closed."""
    warm_up(gateway)
    for _ in range(ATTEMPTS):
        chosen = attempt(gateway, replica, interactive_extra, **batch_extra)
        if chosen is not None:
            return chosen
    raise AssertionError(f"a request ended before the engine's choice was seen, {ATTEMPTS} times")


def attempt(
    gateway: GatewayProcess,
    replica: VLLMReplica,
    interactive_extra: dict[str, Any] | None = None,
    **batch_extra: Any,
) -> str | None:
    """The one request the engine serves first, or None when a request ended before the
    engine's choice could be seen (the holder before both others waited, or the one chosen
    before the test saw it)."""
    order: list[str] = []
    holder = Held(gateway, "batch-key", "holder", stream=False)
    wait_until(lambda: queued(replica, 0) or holder.ended, "the holder running", ENGINE_PATIENCE)
    batch = Held(gateway, "batch-key", "batch", stream=True, order=order, **batch_extra)
    wait_until(
        lambda: queued(replica, 1) or holder.ended, "batch waiting in the engine", ENGINE_PATIENCE
    )
    interactive = Held(
        gateway,
        "interactive-key",
        "interactive",
        stream=True,
        order=order,
        **(interactive_extra or {}),
    )
    wait_until(
        lambda: queued(replica, 2) or holder.ended, "both waiting in the engine", ENGINE_PATIENCE
    )
    # Once both have been seen waiting the engine's choice is made; until then it is not.
    decided = queued(replica, 2)
    holder.close()
    requests = (batch, interactive)
    wait_until(
        lambda: order or any(request.ended for request in requests),
        "a queued request served",
        ENGINE_PATIENCE,
    )
    # The one served runs until it is closed: the other cannot begin before.
    served = list(order)
    decided = decided and not any(request.ended for request in requests)
    for request in requests:
        request.close()
    answered = [request.status for request in (holder, *requests)]
    assert set(answered) <= {0, 200}, (answered, health_seen_by(gateway, replica))
    wait_until(lambda: queued(replica, 0, running=0), "the engine idle", ENGINE_PATIENCE)
    if not decided:
        return None
    assert len(served) == 1, f"served at once, one sequence at a time: {served}"
    return served[0]


def test_the_higher_priority_tenant_is_served_before_one_queued_earlier(
    prioritised: GatewayProcess, replica: VLLMReplica
) -> None:
    # The batch client asks for the front of the queue itself; the gateway sends its tenant's 0.
    assert served_first(prioritised, replica, priority=-1000) == "interactive"


def test_without_the_flag_the_engine_serves_them_as_they_came(
    replica: VLLMReplica, config: Path
) -> None:
    # The later client asks for the front of the queue: its priority does not reach the engine.
    with GatewayProcess([replica.url], "--config", str(config), *NOT_STALLS) as plain:
        assert served_first(plain, replica, {"priority": -1000}) == "batch"


def test_a_tenant_given_a_range_orders_its_own_requests_within_it(
    replica: VLLMReplica, tmp_path: Path
) -> None:
    ranged = [{**TENANTS[0], "priority_range": [-5, 5]}, TENANTS[1]]
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({"tenants": ranged}))
    with GatewayProcess([replica.url], "--config", str(config), *NOT_STALLS) as plain:
        assert served_first(plain, replica, {"priority": -5}) == "interactive"


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
