"""The Prometheus config and alerts pass promtool, and a real Prometheus renders the dashboard.

promtool and prometheus come with Debian's `prometheus` package (.ci/run installs it).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from prefix_gateway import logwatch
from prefix_gateway.emulator.replicas import EmulatedReplicas
from prefix_gateway.logwatch import PROMETHEUS_LOG, LogWatch
from tests.conftest import MODEL
from tests.support import GatewayProcess, free_port, wait_until
from tests.test_dashboards import (
    ALERTS,
    DEPLOY,
    PROMETHEUS_OWN,
    alert_rules,
    dashboard,
    dashboard_queries,
    exported_families,
    metric_names,
    runnable,
    sample_names,
)
from tests.words import words

PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (apt-get install prometheus)"
)
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus is not installed (apt-get install prometheus)"
)


def promtool(*args: str) -> str:
    assert PROMTOOL is not None
    done = subprocess.run(
        [PROMTOOL, *args], capture_output=True, text=True, timeout=60, cwd=DEPLOY / "prometheus"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


@needs_promtool
def test_promtool_accepts_the_scrape_config() -> None:
    assert "SUCCESS" in promtool("check", "config", "prometheus.yml")


@needs_promtool
def test_promtool_accepts_the_alert_rules() -> None:
    assert f"SUCCESS: {len(alert_rules())} rules found" in promtool("check", "rules", "alerts.yml")


@needs_promtool
def test_the_alerts_fire_as_their_unit_tests_expect() -> None:
    assert "SUCCESS" in promtool("test", "rules", "alerts_test.yml")


class Prometheus:
    """A Prometheus server on a free port, scraping one gateway every second."""

    def __init__(self, target: str, folder: Path) -> None:
        assert PROMETHEUS is not None
        self.url = f"http://127.0.0.1:{free_port()}"
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(ALERTS)],
            "scrape_configs": [
                {"job_name": "prefix-gateway", "static_configs": [{"targets": [target]}]}
            ],
        }
        (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
        self._log = (folder / "prometheus.log").open("w+b")
        self._watch = LogWatch(PROMETHEUS_LOG)
        self.process = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={folder / 'prometheus.yml'}",
                f"--storage.tsdb.path={folder / 'data'}",
                f"--web.listen-address={self.url.removeprefix('http://')}",
                "--log.level=warn",
            ],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        logwatch.started(self)
        wait_until(self._ready, "Prometheus to start")

    @property
    def label(self) -> str:
        return f"prometheus {self.url}"

    def unexpected_errors(self) -> list[str]:
        return self._watch.errors(self._log)

    def _ready(self) -> bool:
        try:
            return httpx.get(self.url + "/-/ready", timeout=1).status_code == 200
        except httpx.TransportError:
            return self.process.poll() is not None  # exited: stop waiting, fail below

    def query(self, expr: str) -> list[dict[str, Any]]:
        response = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=5)
        body = response.json()
        assert response.status_code == 200 and body["status"] == "success", (expr, body)
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def value(self, expr: str) -> float:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else 0.0

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        logwatch.ended(self)
        self._log.close()


# The client is a named tenant with budgets, so that the tenant row has series to render.
TENANT = {
    "name": "dashboard",
    "api_key": "dashboard-key",
    "requests_per_minute": 10_000,
    "tokens_per_minute": 1_000_000,
}


@pytest.fixture(scope="module")
def gateway(
    fleet: EmulatedReplicas, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    config = tmp_path_factory.mktemp("tenants") / "gateway.yaml"
    config.write_text(yaml.safe_dump({"tenants": [TENANT]}))
    # The doctor examines each replica once (the "Doctor checks" panel).
    args = ("--config", str(config), "--doctor-interval", "600")
    with GatewayProcess(fleet.urls, *args) as started:
        yield started


@pytest.fixture
def client(gateway: GatewayProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=gateway.url + "/v1", api_key=str(TENANT["api_key"]), max_retries=0
    ) as api:
        yield api


@pytest.fixture(scope="module")
def prometheus(
    gateway: GatewayProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Prometheus]:
    if PROMETHEUS is None:
        pytest.skip("prometheus is not installed (apt-get install prometheus)")
    server = Prometheus(gateway.url.removeprefix("http://"), tmp_path_factory.mktemp("prom"))
    assert server.process.poll() is None, "prometheus exited at start"
    try:
        yield server
    finally:
        server.stop()


def talk(client: openai.OpenAI, tag: str) -> None:
    """Two users sharing a system prompt, a second turn each, and one trimmed history."""
    system = {"role": "system", "content": words(300, f"{tag}s")}
    messages: list[Any] = []
    for user in range(2):
        messages = [system, {"role": "user", "content": words(40, f"{tag}u{user}")}]
        for _ in range(2):
            reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            messages.append({"role": "user", "content": words(20, f"{tag}n{len(messages)}")})
    # One streamed answer: the time to first token's series. Pinned by a session, the answers
    # of two calls with one tag grow one replica's series (a rate needs a series that grows;
    # another test's traffic could otherwise send the second elsewhere).
    for _ in client.chat.completions.create(
        model=MODEL,
        messages=[system, *messages[:2]],
        max_tokens=2,
        stream=True,
        extra_headers={"x-session-id": f"{tag}-streamed"},
    ):
        pass
    client.chat.completions.create(model=MODEL, messages=[system, *messages[3:]], max_tokens=2)


def panel_expr(title: str, legend: str) -> str:
    for panel in dashboard()["panels"]:
        if panel["title"] == title:
            for target in panel["targets"]:
                if target["legendFormat"] == legend:
                    return runnable(target["expr"])
    raise AssertionError(f"no panel {title!r} with a {legend!r} query")


@needs_prometheus
def test_a_real_prometheus_renders_every_panel_from_a_live_gateway(
    prometheus: Prometheus, client: openai.OpenAI
) -> None:
    # More tokens than the tenant's whole minute holds: refused by its own limit.
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "all of it"}], max_tokens=2_000_000
        )
    talk(client, "pa")
    # The trimmed history comes last: once its cache break is scraped, all of the above is.
    wait_until(lambda: bool(prometheus.query("gateway_cache_breaks_total")), "a scrape")
    # The same conversations again, on the same replicas: the series scraped above grow, so
    # their rates over the window are not zero (a series born later starts at its first value).
    talk(client, "pa")

    observed = panel_expr("Predicted vs observed prefix hit rate", "observed")
    wait_until(lambda: prometheus.value(observed) > 0, "the observed hit rate")
    # A ratio of two rates: `rate()` extrapolates each young series on its own, so the ratio
    # of cached to prompt tokens may pass 1 a little while the series are minutes old.
    assert 0 < prometheus.value(observed) < 1.5
    by_route = prometheus.query(panel_expr("Requests / s by route reason", "{{route}}"))
    assert {series["metric"]["route"] for series in by_route} & {"prefix", "hash"}

    empty = []
    for panel in dashboard()["panels"]:
        if panel["type"] == "row":
            continue
        results = [prometheus.query(runnable(target["expr"])) for target in panel["targets"]]
        if not any(results):
            empty.append(panel["title"])
    # Panels of events this traffic does not cause may be empty; every other one has data.
    assert set(empty) <= {
        "Sticky sessions moved / s by cause",
        "Overflows, retries and failovers / s",
        "Upstream errors / s",
        "Redis operation time p99",
        "Redis errors and fallbacks / s",
        "Admission refusals / s",
        "Prefill waits / s",
        "Prefill wait time",
        "Stalls and resends / s",
        "KV-event feeds live",
        "KV-event messages, fallbacks / s",
        "Tenant wait for a replica slot p99",
        # No LoRA adapters in this fleet (tests/test_lora_adapters.py reads those series).
        "Replicas serving each adapter",
        "Adapter loads and unloads / s",
        # The learned time to first token is off by default (tests/test_first_token.py).
        "Predicted vs observed time to first token per backend",
    }, empty
    assert prometheus.value(panel_expr("Cache breaks / min", "breaks/min")) > 0
    streamed = panel_expr("Time to first token (streamed requests)", "p99")
    # Its rate needs a scrape after the second streamed answer, which the waits above do not.
    wait_until(lambda: prometheus.value(streamed) > 0, "the streamed time to first token")
    assert prometheus.value(streamed) <= 3600
    memory = panel_expr("Resident memory per gateway", "{{instance}}")
    assert prometheus.value(memory) > 1_000_000


def test_every_name_in_the_panels_and_alerts_is_in_the_live_metrics(
    gateway: GatewayProcess, client: openai.OpenAI
) -> None:
    talk(client, "names")
    live = gateway.metrics()
    exported = sample_names(exported_families(live)) | PROMETHEUS_OWN
    queries = [*dashboard_queries(), *((rule["alert"], rule["expr"]) for rule in alert_rules())]
    for where, expr in queries:
        missing = metric_names(runnable(expr) if "$" in expr else expr) - exported
        assert not missing, f"{where}: not in the live /metrics: {sorted(missing)}"
        # A bucket bound is matched as the gateway spells it ("5.0", not "5").
        for bound in re.findall(r'le="([^"]*)"', expr):
            assert f'le="{bound}"' in live, f"{where}: no bucket le={bound}"


@needs_prometheus
def test_prometheus_evaluates_every_alert_rule(prometheus: Prometheus) -> None:
    def rules() -> list[dict[str, Any]]:
        body = httpx.get(prometheus.url + "/api/v1/rules", timeout=5).json()
        return [rule for group in body["data"]["groups"] for rule in group["rules"]]

    wait_until(lambda: all(rule["health"] == "ok" for rule in rules()), "the rules to evaluate")
    assert len(rules()) == len(alert_rules())
    firing = prometheus.query('ALERTS{alertstate="firing"}')
    assert firing == []  # four healthy replicas, no Redis configured, nothing to fire
