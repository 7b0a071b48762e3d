"""`prefix-gateway doctor`, and the same checks in the background of `serve`, against real
processes: a healthy emulated replica, one caching blocks of another size than the gateway
hashes, one that reports no cached tokens, and a backend on a closed port; and a replica seen
through a front of the test's own that spoils its `/metrics` or names a KV-event publisher
that cannot be reached or sends what is not vLLM's events."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from engines.tiny_model import Shape, make_tokenizer
from prefix_gateway.doctor.verdicts import (
    COMMON_BLOCK_SIZES,
    block_size_verdict,
    cached_at,
    probe_tokens,
    sizes_reproducing,
)
from prefix_gateway.emulator.process import EmulatorProcess
from prefix_gateway.processes import metric_value
from tests.conftest import MODEL
from tests.support import PATIENCE_SECONDS, ROOT, GatewayProcess, free_port, wait_until
from tests.test_kv_event_feeds import Publisher

CHECKS = ["reachable", "models", "load-metrics", "prefix-caching", "cached-tokens-reported"]
PROBED = ["token-agreement"]


@dataclass
class Fleet:
    healthy: EmulatorProcess
    other_block_size: EmulatorProcess
    no_cached_tokens: EmulatorProcess
    closed: str

    def name(self, replica: EmulatorProcess) -> str:
        return f"{replica.host}:{replica.port}"

    @property
    def urls(self) -> list[str]:
        started = [self.healthy, self.other_block_size, self.no_cached_tokens]
        return [*(replica.url for replica in started), self.closed]


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    with (
        EmulatorProcess(name=MODEL) as healthy,
        EmulatorProcess("--block-size", "32", name=MODEL) as other,
        EmulatorProcess("--no-prompt-tokens-details", name=MODEL) as silent,
    ):
        yield Fleet(healthy, other, silent, f"http://127.0.0.1:{free_port()}")


def doctor(*args: str) -> tuple[int, list[list[str]]]:
    """The exit status of `prefix-gateway doctor ARGS` and its check lines, split into
    status, backend, check and detail."""
    done = subprocess.run(
        [sys.executable, "-m", "prefix_gateway", "doctor", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stdout.splitlines()
    rows = [line.split(None, 3) for line in lines[:-1]]
    assert all(row[0] in ("PASS", "FAIL", "SKIP") for row in rows), done.stdout
    return done.returncode, rows


def by_check(rows: list[list[str]], backend: str) -> dict[str, tuple[str, str]]:
    found = [row for row in rows if row[1] == backend]
    checks = {row[2]: (row[0], row[3]) for row in found}
    assert len(checks) == len(found), "one line per check and replica"
    return checks


def test_a_healthy_replica_passes_every_check(fleet: Fleet) -> None:
    status, rows = doctor("--backend", fleet.healthy.url, "--isolate-tenants", "--api-key", "k")
    checks = by_check(rows, fleet.name(fleet.healthy))
    assert list(checks) == [*CHECKS, *PROBED, "cache-salt"]
    assert {verdict for verdict, _ in checks.values()} == {"PASS"}, rows
    assert status == 0
    assert "not a hit" in checks["cache-salt"][1]


def test_each_replica_is_told_what_is_wrong_with_it(fleet: Fleet) -> None:
    status, rows = doctor(*(part for url in fleet.urls for part in ("--backend", url)))
    assert status == 1

    closed = by_check(rows, fleet.closed.removeprefix("http://"))
    assert closed["reachable"][0] == "FAIL" and "cannot connect" in closed["reachable"][1]
    assert {verdict for check, (verdict, _) in closed.items() if check != "reachable"} == {"SKIP"}

    healthy = by_check(rows, fleet.name(fleet.healthy))
    assert {verdict for verdict, _ in healthy.values()} == {"PASS"}

    other = by_check(rows, fleet.name(fleet.other_block_size))
    verdict, detail = other["token-agreement"]
    assert verdict == "FAIL"
    assert "block size differs" in detail and "blocks of 32 tokens" in detail, detail
    assert "the gateway hashes blocks of 16" in detail
    assert other["prefix-caching"][0] == other["cached-tokens-reported"][0] == "PASS"

    silent = by_check(rows, fleet.name(fleet.no_cached_tokens))
    assert silent["cached-tokens-reported"][0] == "FAIL"
    assert "--enable-prompt-tokens-details" in silent["cached-tokens-reported"][1]
    # Its prefix cache works, as its hit counter shows; agreement cannot be judged.
    assert silent["prefix-caching"] == ("PASS", "the repeat counted prefix-cache hits in /metrics")
    assert silent["token-agreement"][0] == "SKIP"


def test_emulate_starts_replicas_to_examine_with_their_flags_and_stops_them() -> None:
    status, rows = doctor("--emulate", "2", "--emulate-args=--no-prompt-tokens-details")
    backends = sorted({row[1] for row in rows})
    assert len(backends) == 2 and all(name.startswith("127.0.0.1:") for name in backends)
    for backend in backends:
        checks = by_check(rows, backend)
        assert checks["reachable"][0] == "PASS"
        assert checks["cached-tokens-reported"][0] == "FAIL", "the flag reached the replica"
        with pytest.raises(httpx.ConnectError):
            httpx.get(
                f"http://{backend}/health", timeout=PATIENCE_SECONDS
            )  # stopped with the doctor
    assert status == 1


def test_an_engine_ignoring_cache_salt_fails_the_salt_check() -> None:
    with EmulatorProcess("--ignore-cache-salt", name=MODEL) as replica:
        status, rows = doctor("--backend", replica.url, "--isolate-tenants", "--api-key", "k")
    checks = by_check(rows, f"{replica.host}:{replica.port}")
    verdict, detail = checks["cache-salt"]
    assert verdict == "FAIL" and "not isolated" in detail, detail
    assert checks["prefix-caching"][0] == "PASS"
    assert status == 1


def test_a_replica_serving_adapters_is_probed_with_its_base_model(tmp_path: Any) -> None:
    # The adapter's name sorts before the base model's: the probe must still use the base,
    # whose blocks (and KV events) are the ones prefix routing of the base model reads.
    adapter = ("--enable-lora", "--lora-modules", f"aaa-adapter={tmp_path}")
    with EmulatorProcess(*adapter, name=MODEL) as replica:
        status, rows = doctor("--backend", replica.url)
    checks = by_check(rows, f"{replica.host}:{replica.port}")
    verdict, detail = checks["models"]
    assert verdict == "PASS" and "aaa-adapter" in detail, detail
    assert detail.endswith(f"probed with {MODEL}"), detail
    assert status == 0, rows


def test_the_gateway_hashing_the_engines_block_size_agrees(fleet: Fleet) -> None:
    status, rows = doctor("--backend", fleet.other_block_size.url, "--block-tokens", "32")
    checks = by_check(rows, fleet.name(fleet.other_block_size))
    assert checks["token-agreement"][0] == "PASS", checks["token-agreement"]
    assert status == 0


def test_unusable_flags_exit_2(fleet: Fleet) -> None:
    flags = ["--backend", "127.0.0.1:9", "--doctor-interval", "-1"]
    done = subprocess.run(
        [sys.executable, "-m", "prefix_gateway", "doctor", *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "doctor_interval must not be negative" in done.stderr


@pytest.fixture(scope="module")
def gateway(fleet: Fleet) -> Iterator[GatewayProcess]:
    with GatewayProcess(fleet.urls, "--doctor-interval", "1") as started:
        yield started


def examined(gateway: GatewayProcess) -> dict[str, Any]:
    listed = httpx.get(gateway.url + "/admin/backends", timeout=10).json()["data"]
    return {row["name"]: row["checks"] for row in listed}


def test_serve_runs_the_checks_in_the_background(fleet: Fleet, gateway: GatewayProcess) -> None:
    started = [fleet.healthy, fleet.other_block_size, fleet.no_cached_tokens]
    names = [fleet.name(replica) for replica in started]
    wait_until(
        lambda: all(examined(gateway)[name] is not None for name in names),
        "every healthy replica examined",
    )
    checks = examined(gateway)
    assert checks[fleet.closed.removeprefix("http://")] is None  # never healthy, never examined
    assert checks[names[0]]["passed"] is True
    assert checks[names[1]]["passed"] is False
    failing = checks[names[1]]["results"]["token-agreement"]
    assert failing["status"] == "fail" and "block size differs" in failing["detail"]
    assert checks[names[2]]["results"]["cached-tokens-reported"]["status"] == "fail"

    scrape = gateway.metrics()

    def check(backend: str, name: str) -> float:
        return metric_value(scrape, "gateway_backend_check", backend=backend, check=name)

    assert [check(names[0], name) for name in CHECKS + PROBED] == [1.0] * 6
    assert check(names[1], "token-agreement") == 0
    assert check(names[2], "cached-tokens-reported") == 0
    skipped = f'gateway_backend_check{{backend="{names[2]}",check="token-agreement"}}'
    assert skipped not in scrape  # not judged: no series

    # Periodically: a later examination of the same replica.
    first = checks[names[0]]["at"]
    wait_until(lambda: examined(gateway)[names[0]]["at"] > first, "a second examination")

    # The probes went to the replicas directly: routing heard nothing of them.
    assert fleet.healthy.metric("vllm:request_success_total") >= 4
    after = gateway.metrics()
    assert metric_value(after, "gateway_index_blocks") == 0
    assert metric_value(after, "gateway_requests_total") == 0
    assert metric_value(after, "gateway_matched_tokens_predicted_total") == 0


def test_a_replica_added_while_serving_is_examined(gateway: GatewayProcess) -> None:
    with EmulatorProcess("--block-size", "64", name=MODEL) as joining:
        name = f"{joining.host}:{joining.port}"
        added = httpx.post(gateway.url + "/admin/backends", json={"url": joining.url}, timeout=30)
        assert added.status_code == 201 and added.json()["checks"] is None
        wait_until(lambda: examined(gateway)[name] is not None, "the new replica examined")
        agreement = examined(gateway)[name]["results"]["token-agreement"]
        assert agreement["status"] == "fail" and "blocks of 64 tokens" in agreement["detail"]
        series = f'gateway_backend_check{{backend="{name}",check="token-agreement"}} 0.0'
        assert series in gateway.metrics().splitlines()
        removed = httpx.delete(f"{gateway.url}/admin/backends/{name}", timeout=30)
        assert removed.status_code == 200
    # Gone from the pool: its series and its examination with it.
    assert f'backend="{name}"' not in gateway.metrics()
    assert name not in examined(gateway)


def test_a_replica_without_details_answers_null_details(fleet: Fleet) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    reply = httpx.post(fleet.no_cached_tokens.url + "/v1/chat/completions", json=body, timeout=30)
    usage = reply.json()["usage"]
    assert usage["prompt_tokens"] > 0 and usage["prompt_tokens_details"] is None


@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
def test_the_probe_length_tells_the_block_size_apart(block_size: int) -> None:
    aimed = probe_tokens(block_size)
    for tokens in range(aimed - 2, aimed + 3):
        assert tokens % block_size, "not a whole number of blocks"
        ours = cached_at(tokens, block_size)
        assert sizes_reproducing(tokens, ours, block_size) == [block_size]
        assert block_size_verdict(tokens, ours, block_size) is None
    others = [size for size in COMMON_BLOCK_SIZES if size != block_size]
    for size in others:
        verdict = block_size_verdict(aimed, cached_at(aimed, size), block_size)
        assert verdict is not None and f"blocks of {block_size}" in verdict


def test_a_count_no_block_size_explains_is_called_eviction() -> None:
    verdict = block_size_verdict(379, 100, 16)
    assert verdict is not None and "evicted" in verdict


LOAD_SERIES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:generation_tokens_total",
)


class Front:
    """A replica as the doctor sees it through a proxy of the test's own: every request relayed
    to `upstream`, but `/metrics` without the load series (`metrics="bare"`) or answered 500
    (`"error"`), and `/kv_event_sources` answered `sources` when given."""

    def __init__(self, upstream: str, metrics: str = "whole", sources: bytes | None = None):
        front = self
        self.upstream, self.metrics, self.sources = upstream, metrics, sources

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                self.relay("GET")

            def do_POST(self) -> None:
                self.relay("POST")

            def relay(self, method: str) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else None
                if self.path == "/kv_event_sources" and front.sources is not None:
                    return self.answer(200, front.sources)
                if self.path == "/metrics" and front.metrics == "error":
                    return self.answer(500, b"metrics are broken", "text/plain")
                headers = {"content-type": self.headers.get("content-type", "application/json")}
                url = front.upstream + self.path
                relayed = httpx.request(method, url, content=body, headers=headers, timeout=60)
                content = relayed.content
                if self.path == "/metrics" and front.metrics == "bare":
                    lines = content.decode().splitlines()
                    kept = [line for line in lines if not any(s in line for s in LOAD_SERIES)]
                    content = "\n".join(kept).encode()
                kind = relayed.headers.get("content-type", "application/json")
                return self.answer(relayed.status_code, content, kind)

            def answer(self, status: int, body: bytes, kind: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("content-type", kind)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http.server_address[1]}"

    @property
    def name(self) -> str:
        return self.url.removeprefix("http://")

    def __enter__(self) -> Front:
        self.thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.thread.join(30)


def failures(rows: list[list[str]], backend: str) -> dict[str, str]:
    """The failed checks of `backend`, each with its detail."""
    return {
        check: detail
        for check, (verdict, detail) in by_check(rows, backend).items()
        if verdict == "FAIL"
    }


@pytest.mark.parametrize(
    ("metrics", "detail"),
    [
        (
            "bare",
            f"/metrics lacks {', '.join(LOAD_SERIES)}: load and stall detection go without",
        ),
        ("error", "GET /metrics answered 500: metrics are broken"),
    ],
    ids=["without-the-load-series", "answering-500"],
)
def test_a_replica_whose_metrics_the_gateway_cannot_read_fails_load_metrics(
    fleet: Fleet, metrics: str, detail: str
) -> None:
    with Front(fleet.healthy.url, metrics=metrics) as front:
        status, rows = doctor("--backend", front.url)
    assert failures(rows, front.name) == {"load-metrics": detail}
    assert status == 1


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer for `--tokenizer`, which `--kv-events` needs: not the emulator's own, so
    that `token-agreement` fails beside the feed's check, saying so."""
    folder = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(folder, Shape(corpus_words=20_000))
    return folder


def kv_event_failures(fleet: Fleet, tokenizer: Path, sources: bytes) -> tuple[int, dict[str, str]]:
    with Front(fleet.healthy.url, sources=sources) as front:
        status, rows = doctor("--backend", front.url, "--kv-events", "--tokenizer", str(tokenizer))
    failed = failures(rows, front.name)
    assert "tokenizer differs" in failed.pop("token-agreement")
    return status, failed


def test_a_kv_event_publisher_that_cannot_be_reached_fails_kv_events(
    fleet: Fleet, tokenizer: Path
) -> None:
    closed = f"tcp://127.0.0.1:{free_port()}"
    source = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": closed}
    status, failed = kv_event_failures(fleet, tokenizer, json.dumps({"0": source}).encode())
    assert failed == {
        "kv-events": f"no connection to the feed's publisher at {closed}: is its port reachable"
        " from the gateway?"
    }
    assert status == 1


def test_a_kv_event_publisher_sending_garbage_fails_kv_events(
    fleet: Fleet, tokenizer: Path, tmp_path: Path
) -> None:
    publisher = Publisher(tmp_path)
    stop = threading.Event()

    def publish() -> None:
        # From before the doctor subscribes until it is done: a subscriber hears only what
        # is sent once it has connected.
        sequence = 0
        while not stop.wait(0.05):
            publisher.send([(b"kv-events", sequence, b"\xc1 not msgpack")])
            sequence += 1

    sending = threading.Thread(target=publish)
    sending.start()
    try:
        status, failed = kv_event_failures(fleet, tokenizer, publisher.answer())
    finally:
        stop.set()
        sending.join(30)
        publisher.close()
    detail = failed.pop("kv-events")
    assert detail.startswith(f"the feed from {publisher.endpoint} sent ")
    assert detail.endswith(
        " messages, none of them KV-cache events the gateway can read (vLLM's msgpack batches)"
    )
    assert failed == {}
    assert status == 1
