"""Clients that stop reading a stream: their replicas are not blamed, and their streams end.

A client that never reads holds its stream's replica back (TCP backpressure), so the replica
sends nothing; the stall detector must not take that for a stuck engine. Past
`--client-write-timeout` the stream is ended and the replica's request aborted.
"""

from __future__ import annotations

import socket
import threading

import httpx

from loadtest.slow_readers import blocked_reader
from prefix_gateway.emulator.replicas import EmulatedReplicas
from tests.support import PATIENCE_SECONDS, GatewayProcess, metric_value, wait_until

MODEL = "emulated-model"
READERS = 4
# Past what the kernel buffers for a socket on loopback (up to 4 MiB), quickly.
REPLICA_ARGS = ["--decode-ms-per-token", "0.2", "--cache-blocks", "65536"]


def _blocked_reader(url: str, turn: int) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return blocked_reader(host, int(port), turn, max_tokens=100_000)


def _aborted(fleet: EmulatedReplicas) -> float:
    return sum(
        metric_value(
            httpx.get(url + "/metrics", timeout=5).text,
            "vllm:request_success_total",
            finished_reason="abort",
        )
        for url in fleet.urls
    )


def test_clients_that_stop_reading_eject_no_replica_and_are_cut_off() -> None:
    with (
        EmulatedReplicas(2, MODEL, REPLICA_ARGS) as fleet,
        GatewayProcess(
            fleet.urls, "--client-write-timeout", "4", "--stall-seconds", "1"
        ) as gateway,
    ):
        readers = [_blocked_reader(gateway.url, turn) for turn in range(READERS)]
        answers: list[int] = []
        failures: list[str] = []
        running = threading.Event()
        running.set()

        def normal_client() -> None:
            with httpx.Client(base_url=gateway.url, timeout=30) as client:
                turn = 0
                while running.is_set():
                    turn += 1
                    question = {"role": "user", "content": f"a short question {turn}"}
                    body = {"model": MODEL, "messages": [question], "max_tokens": 8}
                    try:
                        answer = client.post("/v1/chat/completions", json=body)
                    except httpx.HTTPError as error:
                        failures.append(repr(error))
                        continue
                    if answer.status_code != 200:
                        failures.append(f"{answer.status_code} {answer.text[:200]}")
                    answers.append(answer.status_code)

        normal = threading.Thread(target=normal_client)
        normal.start()
        try:
            # The blocked streams end only once their client has not read for the write
            # timeout, several stall thresholds long: by then a wrong verdict would have come.
            wait_until(lambda: _aborted(fleet) >= READERS, "the blocked streams aborted")
            done = len(answers)
            wait_until(lambda: len(answers) > done + 5, "normal requests served after")
        finally:
            running.clear()
            normal.join(60)
        assert not failures, failures[:5]
        text = gateway.metrics()
        assert metric_value(text, "gateway_backend_stalls_total") == 0
        assert metric_value(text, "gateway_client_disconnects_total") == READERS
        listing = httpx.get(gateway.url + "/admin/backends", timeout=5).json()["data"]
        assert all(item["healthy"] and not item["stalled"] for item in listing), listing
        # Every replica's request for a blocked reader was aborted, none generated to its end.
        wait_until(
            lambda: all(
                metric_value(
                    httpx.get(url + "/metrics", timeout=PATIENCE_SECONDS).text,
                    "vllm:num_requests_running",
                )
                == 0
                for url in fleet.urls
            ),
            "no request left running on the replicas",
        )
        # The gateway closed each blocked reader's connection: reading it ends in EOF or reset.
        for reader in readers:
            reader.settimeout(30)
            try:
                while reader.recv(65536):
                    pass
            except ConnectionResetError:
                pass
            reader.close()
        assert not gateway.tracebacks() and not fleet.tracebacks()
        assert "without completing response" not in gateway.log()
