"""`serve --metrics-port P`: `/metrics` alone on a port of its own, nothing else there, a 404 for
it on the API's port; one process and several workers alike; a port that cannot be bound stops
the start.

Real processes throughout: emulated replicas, the gateway (and its workers), raw sockets where
an HTTP client would not send what is tested, and a real Prometheus where one is installed.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefix_gateway.emulator.replicas import EmulatedReplicas
from prefix_gateway.server import WORKER_HEADER
from tests.conftest import MODEL
from tests.support import GatewayProcess, free_port, metric_value, read_to_close, wait_until
from tests.test_prometheus import Prometheus, needs_prometheus

MAX_HEADER_BYTES = 4096
LIMITS = ("--max-header-bytes", str(MAX_HEADER_BYTES), "--head-timeout", "2")


@pytest.fixture(scope="module")
def replicas() -> Iterator[EmulatedReplicas]:
    with EmulatedReplicas(2, MODEL, ["--chat-template", "plain"]) as started:
        yield started


@pytest.fixture(scope="module")
def gateway(replicas: EmulatedReplicas) -> Iterator[GatewayProcess]:
    with GatewayProcess(replicas.urls, *LIMITS, metrics_port=True) as started:
        yield started


@pytest.fixture(scope="module")
def workers(replicas: EmulatedReplicas) -> Iterator[GatewayProcess]:
    with GatewayProcess(replicas.urls, "--workers", "2", metrics_port=True) as started:
        yield started


def chat(gateway: GatewayProcess, text: str) -> str:
    """One chat request on a connection of its own (any worker may take it); its worker."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    answer = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    return str(answer.headers.get(WORKER_HEADER, ""))


def error_code(answer: httpx.Response) -> str:
    """The OpenAI error code of a 404, checking the rest of its shape on the way."""
    assert answer.status_code == 404, (answer.status_code, answer.text)
    assert answer.headers["content-type"] == "application/json"
    error = orjson.loads(answer.content)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    return str(error["code"])


def families(text: str) -> set[str]:
    return {family.name for family in text_string_to_metric_families(text)}


def test_the_metrics_port_serves_the_gateways_series_and_counts_requests(
    gateway: GatewayProcess,
) -> None:
    before = metric_value(gateway.metrics(), "gateway_requests_total", status="200")
    for number in range(5):
        chat(gateway, f"counted {number}")
    scrape = httpx.get(gateway.metrics_url + "/metrics", timeout=5)
    assert scrape.status_code == 200
    assert scrape.headers["content-type"].startswith("text/plain")
    assert metric_value(scrape.text, "gateway_requests_total", status="200") - before == 5
    assert {"gateway_requests", "gateway_backend_healthy", "gateway_workers"} <= families(
        scrape.text
    )


def test_the_api_port_answers_404_for_metrics_and_serves_the_rest(
    gateway: GatewayProcess,
) -> None:
    assert error_code(httpx.get(gateway.url + "/metrics", timeout=5)) == "metrics_elsewhere"
    # The port is the connection's own: no header names another.
    posing = {"host": f"127.0.0.1:{gateway.metrics_port}", "x-forwarded-port": "1"}
    answer = httpx.get(gateway.url + "/metrics", headers=posing, timeout=5)
    assert error_code(answer) == "metrics_elsewhere"
    for path in ("/health", "/ready", "/v1/models", "/admin/backends"):
        assert httpx.get(gateway.url + path, timeout=5).status_code == 200, path
    chat(gateway, "still served")
    described = httpx.get(gateway.url + "/openapi.json", timeout=5).json()["paths"]
    assert "/metrics" not in described and "/v1/chat/completions" in described


def test_the_metrics_port_serves_nothing_but_metrics(
    gateway: GatewayProcess, replicas: EmulatedReplicas
) -> None:
    metrics_url = gateway.metrics_url
    before = gateway.metrics()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "not here"}]}
    stranger = {"url": f"http://127.0.0.1:{free_port()}"}
    answers = [
        httpx.post(metrics_url + "/v1/chat/completions", json=body, timeout=5),
        httpx.get(metrics_url + "/admin/backends", timeout=5),
        httpx.post(metrics_url + "/admin/backends", json=stranger, timeout=5),
        httpx.post(metrics_url + "/admin/explain", json=body, timeout=5),
        *(
            httpx.get(metrics_url + path, timeout=5)
            for path in ("/health", "/ready", "/v1/models", "/openapi.json", "/", "/metrics/")
        ),
    ]
    assert [error_code(answer) for answer in answers] == ["metrics_port_only"] * len(answers)
    # Nothing reached the proxy or the admin API, and nothing was counted as a rejection.
    listed = httpx.get(gateway.url + "/admin/backends", timeout=5).json()
    assert len(listed["data"]) == len(replicas.urls)
    after = gateway.metrics()
    for name in ("gateway_requests_total", "gateway_rejected_requests_total"):
        assert metric_value(after, name) == metric_value(before, name), name
    wrong_method = httpx.post(metrics_url + "/metrics", timeout=5)
    assert (wrong_method.status_code, wrong_method.headers["allow"]) == (405, "GET")


def raw_exchange(port: int, sent: bytes) -> bytes:
    """What the gateway answers `sent` on `port`, read until it closes the connection."""
    with socket.create_connection(("127.0.0.1", port)) as raw:
        raw.settimeout(30)
        raw.sendall(sent)
        return read_to_close(raw)


def test_the_metrics_port_bounds_request_heads_as_the_api_port_does(
    gateway: GatewayProcess,
) -> None:
    padding = b"x-padding: " + b"p" * MAX_HEADER_BYTES + b"\r\n"
    too_large = raw_exchange(gateway.metrics_port, b"GET /metrics HTTP/1.1\r\n" + padding)
    assert too_large.startswith(b"HTTP/1.1 431 "), too_large[:100]
    assert b'"code":"headers_too_large"' in too_large
    never_ends = raw_exchange(gateway.metrics_port, b"GET /metrics HTTP/1.1\r\nhost: x\r\n")
    assert never_ends.startswith(b"HTTP/1.1 408 "), never_ends[:100]
    assert b'"code":"head_timeout"' in never_ends


def each_worker(url: str) -> dict[str, httpx.Response]:
    """`GET url` as answered by each of two workers, on fresh connections until both have."""
    answers: dict[str, httpx.Response] = {}
    for _ in range(200):
        response = httpx.get(url, timeout=5)
        answers.setdefault(response.headers[WORKER_HEADER], response)
        if len(answers) == 2:
            return answers
    raise AssertionError(f"only workers {sorted(answers)} answered {url}")


def test_with_workers_each_one_serves_the_pods_summed_counts_on_the_metrics_port(
    workers: GatewayProcess,
) -> None:
    wait_until(lambda: workers.metric("gateway_workers") == 2, "both workers serving")
    before = metric_value(workers.metrics(), "gateway_requests_total")
    with ThreadPoolExecutor(8) as pool:
        served_by = set(pool.map(lambda number: chat(workers, f"worker {number}"), range(48)))
    assert served_by == {"0", "1"}
    for worker, scrape in each_worker(workers.metrics_url + "/metrics").items():
        assert scrape.status_code == 200, worker
        assert metric_value(scrape.text, "gateway_requests_total") - before == 48, worker
        assert metric_value(scrape.text, "gateway_workers") == 2, worker
    for worker, answer in each_worker(workers.url + "/metrics").items():
        assert error_code(answer) == "metrics_elsewhere", worker
    for worker, answer in each_worker(workers.metrics_url + "/admin/backends").items():
        assert error_code(answer) == "metrics_port_only", worker


def test_without_the_flag_metrics_stay_on_the_api_port(replicas: EmulatedReplicas) -> None:
    with GatewayProcess(replicas.urls) as plain:
        chat(plain, "one")
        scrape = httpx.get(plain.url + "/metrics", timeout=5)
        assert scrape.status_code == 200
        assert metric_value(scrape.text, "gateway_requests_total", status="200") == 1
        assert "/metrics" in httpx.get(plain.url + "/openapi.json", timeout=5).json()["paths"]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_metrics_port_already_taken_stops_the_start_and_frees_the_api_port(
    workers: str,
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        metrics_port = taken.getsockname()[1]
        api_port = free_port()
        command = [sys.executable, "-m", "prefix_gateway", "serve", "--backend", "http://127.0.0.1:1"]
        command += ["--port", str(api_port), "--metrics-port", str(metrics_port)]
        command += ["--workers", workers, "--log-level", "warning"]
        ended = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert ended.returncode == 3, ended.stderr
    assert "cannot listen" in ended.stderr and "Traceback" not in ended.stderr
    with socket.create_server(("127.0.0.1", api_port)):
        pass  # the API's port was not left bound


@needs_prometheus
def test_a_real_prometheus_scrapes_the_metrics_port(
    gateway: GatewayProcess, tmp_path: Path
) -> None:
    chat(gateway, "scraped")
    server = Prometheus(f"127.0.0.1:{gateway.metrics_port}", tmp_path)
    try:
        up = 'up{job="prefix-gateway"}'
        wait_until(lambda: server.query(up), "a first scrape")
        assert server.value(up) == 1
        wait_until(lambda: server.value("sum(gateway_requests_total)") >= 1, "the requests")
    finally:
        server.stop()
