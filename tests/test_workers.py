"""`serve --workers 2`: one port, two worker processes under a supervisor, metrics summed, and
each worker enforcing its half of every tenant's limit (docs/tenants.md).

Real processes throughout: emulated replicas, the gateway's supervisor and its workers, the
official `openai` client.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from prometheus_client.mmap_dict import MmapedDict, mmap_key

from prefix_gateway.config import ConfigError, load_settings
from prefix_gateway.emulator.replicas import EmulatedReplicas
from prefix_gateway.server import WORKER_HEADER
from tests.conftest import MODEL
from tests.holding_replica import HoldingReplica
from tests.support import PATIENCE_SECONDS, GatewayProcess, metric_value, wait_until


@pytest.fixture(scope="module")
def replicas() -> Iterator[EmulatedReplicas]:
    with EmulatedReplicas(2, MODEL, ["--chat-template", "plain"]) as started:
        yield started


@pytest.fixture(scope="module")
def gateway(replicas: EmulatedReplicas) -> Iterator[GatewayProcess]:
    with GatewayProcess(replicas.urls, "--workers", "2") as started:
        yield started


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue  # ended meanwhile
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def worker_pids(gateway: GatewayProcess) -> list[int]:
    """The supervisor's children that run the gateway (not multiprocessing's own helper)."""
    return [
        pid
        for pid in children(gateway.pid)
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]


def exists(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def chat(base_url: str, text: str) -> str:
    """One request on a connection of its own, so that any worker may accept it."""
    with openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=3) as client:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=4
        )
        assert raw.parse().choices[0].message.content
        return raw.headers[WORKER_HEADER]


def chats_until_both_served(gateway: GatewayProcess, tag: str, at_least: int) -> Counter[str]:
    """Which worker answered each of at least `at_least` requests, 8 at a time, sent until both
    have answered: the kernel hands a shared socket's connections to whichever worker accepts
    first, and on a busy machine one of them may take many in a row."""
    served_by: Counter[str] = Counter()
    with ThreadPoolExecutor(8) as pool:
        for batch in range(50):
            if sum(served_by.values()) >= at_least and len(served_by) == 2:
                return served_by
            texts = [f"{tag} {batch} {n}" for n in range(8)]
            served_by.update(pool.map(lambda text: chat(gateway.url, text), texts))
    raise AssertionError(f"only workers {sorted(served_by)} answered 400 requests")


def each_worker(gateway: GatewayProcess, path: str) -> dict[str, httpx.Response]:
    """`GET path` as answered by each worker, on fresh connections until both have answered."""
    answers: dict[str, httpx.Response] = {}
    for _ in range(200):
        response = httpx.get(gateway.url + path, timeout=5)
        answers.setdefault(response.headers[WORKER_HEADER], response)
        if len(answers) == 2:
            return answers
    raise AssertionError(f"only workers {sorted(answers)} answered {path}")


def scrape_each_worker(gateway: GatewayProcess) -> dict[str, str]:
    return {worker: answer.text for worker, answer in each_worker(gateway, "/metrics").items()}


def readiness(gateway: GatewayProcess) -> set[int]:
    """The `/ready` statuses of both workers."""
    return {answer.status_code for answer in each_worker(gateway, "/ready").values()}


def test_both_workers_serve_and_every_scrape_counts_all_requests(
    gateway: GatewayProcess, replicas: EmulatedReplicas
) -> None:
    before = gateway.metrics()
    sent = sum(chats_until_both_served(gateway, "hello", 48).values())
    for worker, text in scrape_each_worker(gateway).items():
        for name, labels in (
            ("gateway_requests_total", {}),
            ("gateway_requests_total", {"status": "200"}),
            # Histograms are summed too.
            ("gateway_upstream_duration_seconds_count", {}),
        ):
            added = metric_value(text, name, **labels) - metric_value(before, name, **labels)
            assert added == sent, (worker, name)
        assert "# HELP gateway_requests_total Requests answered" in text
        assert metric_value(text, "gateway_workers") == 2
        for url in replicas.urls:
            backend = url.removeprefix("http://")
            assert metric_value(text, "gateway_backend_healthy", backend=backend) == 1


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def resident_bytes(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def started_at(pid: int) -> float:
    """Seconds since the epoch, as the process collector computes it."""
    ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    boot = next(
        float(line.split()[1])
        for line in Path("/proc/stat").read_text().splitlines()
        if line.startswith("btime ")
    )
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def test_the_process_series_are_the_whole_pod(gateway: GatewayProcess) -> None:
    workers = worker_pids(gateway)
    cpu_before = sum(cpu_seconds(pid) for pid in workers)
    largest = max(resident_bytes(pid) for pid in workers)

    def reported(name: str) -> float:
        return metric_value(gateway.metrics(), name)

    # Each process publishes its own every second: the sums reach the workers' together, more
    # than any one of them holds.
    wait_until(lambda: reported("process_cpu_seconds_total") >= cpu_before, "CPU summed")
    wait_until(lambda: reported("process_resident_memory_bytes") > largest, "memory summed")
    assert reported("process_open_fds") > 0
    # The supervisor's own start, before it started any worker, is the pod's.
    supervisor = started_at(gateway.pid)
    assert supervisor < min(started_at(pid) for pid in workers)
    wait_until(
        lambda: abs(reported("process_start_time_seconds") - supervisor) < 0.05,
        "the supervisor's start time",
    )


def test_a_killed_worker_is_restarted_and_counted_and_requests_keep_succeeding(
    gateway: GatewayProcess,
) -> None:
    before = metric_value(gateway.metrics(), "gateway_requests_total")
    victim, survivor = sorted(worker_pids(gateway))
    # The supervisor reports a worker's death at ERROR: the one killed here.
    gateway.expect_log(rf"worker \d \(pid {victim}\) exited with status -9")
    os.kill(victim, signal.SIGKILL)
    # Served throughout: by the survivor, then by both.
    served_by = Counter(chat(gateway.url, f"after the kill {tag}") for tag in range(30))
    wait_until(lambda: len(worker_pids(gateway)) == 2, "a new worker")
    replacement = (set(worker_pids(gateway)) - {survivor}).pop()
    assert replacement != victim and not exists(victim)
    wait_until(
        lambda: metric_value(gateway.metrics(), "gateway_workers") == 2, "the replacement serving"
    )
    served_by += chats_until_both_served(gateway, "later", 40)
    for text in scrape_each_worker(gateway).values():
        assert metric_value(text, "gateway_worker_restarts_total") == 1
        # The dead worker's counts stay in the total.
        assert metric_value(text, "gateway_requests_total") - before == sum(served_by.values())


def stale_counter_file(directory: Path) -> None:
    """A file an earlier run left, as prometheus_client writes it: 1000 requests."""
    stale = MmapedDict(str(directory / "counter_999999.db"))
    key = mmap_key(
        "gateway_requests",
        "gateway_requests_total",
        ["model", "backend", "route", "status"],
        [MODEL, "earlier", "prefix", "200"],
        "",
    )
    stale.write_value(key, 1000.0, 0.0)
    stale.close()


def test_sigterm_to_the_supervisor_stops_every_worker_gracefully(
    replicas: EmulatedReplicas, tmp_path: Path
) -> None:
    stale_counter_file(tmp_path)
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    # A delay no busy machine outlasts: the second signal below ends it.
    args = ("--workers", "2", "--shutdown-delay", "120")
    with GatewayProcess(replicas.urls, *args, env=env) as gateway:
        chat(gateway.url, "one request")
        # The earlier run's file was removed before the workers started.
        assert metric_value(gateway.metrics(), "gateway_requests_total") == 1
        wait_until(lambda: len(worker_pids(gateway)) == 2, "both workers")
        wait_until(lambda: readiness(gateway) == {200}, "both workers ready")
        family = children(gateway.pid)
        os.kill(gateway.pid, signal.SIGTERM)
        # Every worker says no, keeps the port open and still serves through the delay.
        wait_until(lambda: readiness(gateway) == {503}, "both workers saying not ready")
        assert chat(gateway.url, "during the delay") in {"0", "1"}
        assert gateway.running and all(exists(pid) for pid in family)
        os.kill(gateway.pid, signal.SIGTERM)  # the second signal skips the rest of the delay
        wait_until(lambda: not gateway.running, "the supervisor's exit")
        assert gateway.stop() == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(gateway.url + "/health", timeout=PATIENCE_SECONDS)
    wait_until(lambda: not any(exists(pid) for pid in family), "no process left")


def test_workers_must_be_at_least_one() -> None:
    with pytest.raises(ConfigError, match="workers"):
        load_settings(environ={"GATEWAY_WORKERS": "0", "GATEWAY_BACKENDS": "http://a:1"})
    assert load_settings(environ={"GATEWAY_BACKENDS": "http://a:1"}).workers == 1


TENANTS = [
    {"name": "split", "api_key": "split-key", "requests_per_minute": 10},
    {"name": "other", "api_key": "other-key", "requests_per_minute": 10},
    {"name": "tokens", "api_key": "tokens-key", "tokens_per_minute": 1000},
]


@pytest.fixture(scope="module")
def tenant_gateway(
    replicas: EmulatedReplicas, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    config = tmp_path_factory.mktemp("tenants") / "gateway.yaml"
    config.write_text(yaml.safe_dump({"tenants": TENANTS}))
    with GatewayProcess(replicas.urls, "--workers", "2", "--config", str(config)) as started:
        yield started


def ask(gateway: GatewayProcess, key: str, text: str, max_tokens: int = 2) -> httpx.Response:
    """One request on a connection of its own, so that any worker may accept it."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
    return httpx.post(
        gateway.url + "/v1/chat/completions",
        json={**body, "max_tokens": max_tokens},
        headers={"authorization": f"Bearer {key}"},
        timeout=60,
    )


def by_worker(
    send: Callable[[int], httpx.Response], enough: Callable[[list[httpx.Response]], bool]
) -> dict[str, list[httpx.Response]]:
    """The answers to requests `send(0)`, `send(1)` and on, sent one after another, per worker
    that gave them, until `enough` of each worker's answers have come."""
    answers: dict[str, list[httpx.Response]] = {"0": [], "1": []}
    for number in range(400):
        if all(enough(given) for given in answers.values()):
            return answers
        answer = send(number)
        answers[answer.headers[WORKER_HEADER]].append(answer)
    raise AssertionError(f"not enough answers from each worker: {answers}")


def refused(answers: list[httpx.Response]) -> bool:
    return any(answer.status_code == 429 for answer in answers)


def test_each_worker_enforces_half_a_tenants_limit_and_shows_the_whole(
    tenant_gateway: GatewayProcess,
) -> None:
    began = time.monotonic()
    answers = by_worker(lambda number: ask(tenant_gateway, "split-key", f"split {number}"), refused)
    # A worker's half of 10 a minute comes back at one every 12 s.
    extra = math.floor((time.monotonic() - began) * 5 / 60)
    for worker, given in answers.items():
        statuses = [answer.status_code for answer in given]
        # Five each, then refusals (or one more per 12 s the requests took): ten in all.
        assert 5 <= statuses.index(429) <= 5 + extra, (worker, statuses)
        assert statuses[:5] == [200] * 5
        assert statuses.count(200) <= 5 + extra
        # The headers show the tenant's whole figures: what is left of the worker's share,
        # scaled up to the limit.
        assert {answer.headers["x-ratelimit-limit-requests"] for answer in given} == {"10"}
        remaining = [int(answer.headers["x-ratelimit-remaining-requests"]) for answer in given]
        assert remaining[0] == 8
        assert all(left <= 8 - 2 * turn + 2 * extra for turn, left in enumerate(remaining[:5]))
        refusal = given[statuses.index(429)]
        message = refusal.json()["error"]["message"]
        assert message == "rate limit reached for tenant split on requests per minute: limit 10"
        assert int(refusal.headers["retry-after"]) >= 1
    # Another tenant's budget is its own: each worker serves it.
    others = by_worker(lambda number: ask(tenant_gateway, "other-key", f"other {number}"), bool)
    assert {answer.status_code for given in others.values() for answer in given} == {200}
    for worker, listing in each_worker(tenant_gateway, "/admin/tenants").items():
        (split,) = [row for row in listing.json()["data"] if row["name"] == "split"]
        assert split["limits"]["requests_per_minute"] == 10, worker
        assert split["budgets"]["requests"]["share"] == 0.5
        assert split["budgets"]["requests"]["shared"] is False


def test_a_request_larger_than_a_workers_share_of_a_token_limit_is_too_large(
    tenant_gateway: GatewayProcess,
) -> None:
    def large(number: int) -> httpx.Response:
        # About 600 tokens: within the tenant's 1,000 a minute, beyond a worker's 500.
        return ask(tenant_gateway, "tokens-key", f"large {number}", max_tokens=600)

    answers = by_worker(large, bool)
    for given in answers.values():
        for answer in given:
            assert answer.status_code == 429
            message = answer.json()["error"]["message"]
            assert message.startswith(
                "request too large for tenant tokens on tokens per minute: limit 1000, requested"
            )
            assert "retry-after" not in answer.headers  # waiting would not help
    assert ask(tenant_gateway, "tokens-key", "within a share", max_tokens=300).status_code == 200


def test_each_worker_holds_a_tenants_whole_concurrency(tmp_path: Path) -> None:
    """Without Redis a tenant's `max_concurrency` is each worker's: with 2, two requests in
    flight at each worker, four in all, and each worker refuses a third."""
    config = tmp_path / "gateway.yaml"
    capped = {"name": "capped", "api_key": "capped-key", "max_concurrency": 2}
    config.write_text(yaml.safe_dump({"tenants": [capped]}))
    answers: dict[str, httpx.Response] = {}

    def send(url: str, text: str) -> None:
        body = {"model": "held-model", "messages": [{"role": "user", "content": text}]}
        answers[text] = httpx.post(
            url + "/v1/chat/completions",
            json=body,
            headers={"authorization": "Bearer capped-key"},
            timeout=120,
        )

    # The replica holds requests until the test lets them go: not a stall.
    args = ("--workers", "2", "--config", str(config), "--stall-seconds", "600")
    with HoldingReplica() as replica:
        try:
            with GatewayProcess([f"held-model={replica.url}"], *args) as pod:
                senders: list[threading.Thread] = []
                refused_by: set[str] = set()
                for number in range(400):
                    if len(refused_by) == 2:
                        break
                    text = f"capped {number}"
                    senders.append(threading.Thread(target=send, args=(pod.url, text)))
                    senders[-1].start()
                    wait_until(
                        lambda text=text: text in replica.arrived or text in answers,  # type: ignore[misc]
                        f"{text} held or answered",
                    )
                    if text in answers:
                        refusal = answers[text]
                        assert refusal.status_code == 429, refusal.text
                        assert "2 requests in flight" in refusal.json()["error"]["message"]
                        refused_by.add(refusal.headers[WORKER_HEADER])
                assert refused_by == {"0", "1"}
                assert replica.held == 4
                replica.release(4)
                for sender in senders:
                    sender.join(120)
        finally:
            replica.release(100)  # whatever still waits is let go
    served = [answer for answer in answers.values() if answer.status_code == 200]
    assert sorted(answer.headers[WORKER_HEADER] for answer in served) == ["0", "0", "1", "1"]
