"""The Grafana dashboard and the alert rules name only metrics the gateway exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from prefix_gateway.metrics import Metrics

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "prefix-gateway.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
DOCS = DEPLOY.parent / "docs"
RUNBOOK = "https://github.com/prefix-gateway/prefix-gateway/blob/main/docs/runbook.md#"
"""Where the rules ship pointing: the runbook on the project's repository (scripts/runbook_urls.py
points them elsewhere)."""
# Series Prometheus makes itself, about its scrape of the gateway.
PROMETHEUS_OWN = {"up"}

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENTIFIER = re.compile(r"(?<![\w$.])([a-zA-Z_:][a-zA-Z0-9_:]*)\b(\s*\()?")
_KEYWORDS = {"and", "or", "unless", "offset", "bool", "by", "without", "on", "ignoring", "inf"}
# What the dashboard's Grafana variables stand for when a query is run outside Grafana.
VARIABLES = {"$__rate_interval": "1m", "$instance": ".*", "$model": ".*"}


def exported_families(exposition: str) -> dict[str, str]:
    """`{name: type}` from the `# TYPE` lines of a /metrics page."""
    families = {}
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            families[name] = kind
    return families


def sample_names(families: dict[str, str]) -> set[str]:
    names: set[str] = set()
    for name, kind in families.items():
        if kind == "histogram":
            names.update(name + suffix for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(name)
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, labels and keywords left out)."""
    stripped = _STRING.sub('""', expr)
    stripped = _MATCHERS.sub(" ", _RANGE.sub(" ", _GROUPING.sub(" ", stripped)))
    return {
        name
        for name, call in _IDENTIFIER.findall(stripped)
        if not call and name.lower() not in _KEYWORDS
    }


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expression) for every query of every panel, variables left in."""
    return [
        (panel["title"], target["expr"])
        for panel in dashboard()["panels"]
        if panel["type"] != "row"
        for target in panel["targets"]
    ]


def runnable(expr: str) -> str:
    for variable, value in VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, expr
    return expr


def alert_rules(path: Path = ALERTS) -> list[dict[str, Any]]:
    loaded = yaml.safe_load(path.read_text())
    return [rule for group in loaded["groups"] for rule in group["rules"]]


FAMILIES = exported_families(Metrics().render().decode())
EXPORTED = sample_names(FAMILIES)


@pytest.mark.parametrize(
    ("where", "expr"),
    [*dashboard_queries(), *((rule["alert"], rule["expr"]) for rule in alert_rules())],
)
def test_every_query_names_exported_metrics(where: str, expr: str) -> None:
    named = metric_names(runnable(expr) if "$" in expr else expr)
    assert named, f"{where}: no metric in {expr}"
    assert named <= EXPORTED | PROMETHEUS_OWN, f"{where}: not exported: {sorted(named - EXPORTED)}"


def test_the_name_extraction_sees_through_promql() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, backend) (rate(a_bucket{model=~"x|y", b="c"}[5m])))'
        " / on (job) group_left (model) (b_total offset 10m or vector(0)) and bool c > 1e-05"
    )
    assert metric_names(expr) == {"a_bucket", "b_total", "c"}
    assert metric_names("gatway_requests_total") == {"gatway_requests_total"}
    assert "gatway_requests_total" not in EXPORTED


def test_the_dashboard_covers_what_operators_watch() -> None:
    used = {name for _, expr in dashboard_queries() for name in metric_names(runnable(expr))}
    for needed in (
        "gateway_requests_total",
        "gateway_matched_tokens_predicted_total",
        "gateway_prompt_tokens_estimated_total",
        "gateway_upstream_cached_tokens_total",
        "gateway_upstream_prompt_tokens_total",
        "gateway_affinity_hits_total",
        "gateway_affinity_misses_total",
        "gateway_cache_breaks_total",
        "gateway_backend_in_flight",
        "gateway_backend_queued",
        "gateway_backend_load_bound",
        "gateway_upstream_first_byte_seconds_bucket",
        "gateway_load_bound_overflows_total",
        "gateway_backend_healthy",
        "gateway_redis_up",
        "gateway_redis_fallbacks_total",
        "gateway_tenant_requests_total",
        "gateway_tenant_tokens_total",
        "gateway_tenant_refusals_total",
        "gateway_tenant_in_flight",
        "gateway_tenant_budget_remaining",
    ):
        assert needed in used, needed
    queries = " ".join(expr for _, expr in dashboard_queries())
    assert "sum by (route) (rate(gateway_requests_total" in queries
    assert "histogram_quantile(0.99, sum by (le) (rate(gateway_upstream_first_byte" in queries


def test_the_dashboard_is_well_formed() -> None:
    board = dashboard()
    assert board["uid"] == "prefix-gateway"
    panels = board["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels)
    variables = {item["name"] for item in board["templating"]["list"]}
    assert variables == {"datasource", "instance", "model"}
    for panel in panels:
        position = panel["gridPos"]
        assert position["x"] + position["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["description"] and panel["datasource"]["uid"] == "${datasource}"
        references = [target["refId"] for target in panel["targets"]]
        assert len(set(references)) == len(references) >= 1, panel["title"]


def test_provisioning_points_at_the_dashboards_and_prometheus() -> None:
    provisioning = DEPLOY / "grafana" / "provisioning"
    sources = [
        source
        for path in sorted((provisioning / "datasources").glob("*.yaml"))
        for source in yaml.safe_load(path.read_text())["datasources"]
    ]
    assert [source["type"] for source in sources] == ["prometheus"]
    providers = [
        provider
        for path in sorted((provisioning / "dashboards").glob("*.yaml"))
        for provider in yaml.safe_load(path.read_text())["providers"]
    ]
    assert [provider["options"]["path"] for provider in providers] == [
        "/var/lib/grafana/dashboards"
    ]


def family_of(name: str) -> str:
    """The exported family a sample name belongs to (a histogram's `_bucket` is its own)."""
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and FAMILIES.get(name.removesuffix(suffix)) == "histogram":
            return name.removesuffix(suffix)
    return name


def said_to_be_off_the_dashboard() -> set[str]:
    """The names in the table of docs/metrics.md's section "Not on the dashboard"."""
    text = (DOCS / "metrics.md").read_text()
    section = text.split("## Not on the dashboard", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([a-z_:]+)` \|", section, re.MULTILINE))


def test_every_exported_family_is_on_a_panel_or_docs_say_why_not() -> None:
    on_panels = {
        family_of(name) for _, expr in dashboard_queries() for name in metric_names(runnable(expr))
    }
    off = said_to_be_off_the_dashboard()
    assert sorted(set(FAMILIES) - on_panels - off) == [], "on no panel, and no reason given"
    assert sorted(off & on_panels) == [], "on a panel after all"
    assert off <= set(FAMILIES)


def test_time_to_first_token_is_of_streamed_requests_alone() -> None:
    for title, expr in dashboard_queries():
        if "gateway_upstream_first_byte_seconds" in expr:
            assert 'stream="true"' in expr, title


def test_every_alert_has_a_runbook_section() -> None:
    runbook = (DOCS / "runbook.md").read_text()
    sections = {
        heading: body
        for heading, body in re.findall(r"^## (\w+)\n(.*?)(?=^## |\Z)", runbook, re.M | re.S)
    }
    alerts = {rule["alert"]: rule for rule in alert_rules()}
    assert set(sections) == set(alerts)
    for name, rule in alerts.items():
        link = urlsplit(rule["annotations"]["runbook_url"])
        # Alertmanager and Grafana open the link as it is: it must be absolute.
        assert (link.scheme, link.netloc) == ("https", "github.com"), name
        assert link.geturl() == RUNBOOK + name.lower(), name
        for part in ("**Means.**", "**Check.**", "**Do.**"):
            assert part in sections[name], (name, part)


def test_one_command_points_every_runbook_link_at_another_base(tmp_path: Path) -> None:
    root = DEPLOY.parent
    for part in ("deploy/prometheus", "deploy/grafana", "k8s/components/monitoring"):
        shutil.copytree(root / part, tmp_path / part)
    base = "https://docs.example/prefix-gateway/runbook.html"

    def script(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, str(root / "scripts" / "runbook_urls.py"), *args]
        return subprocess.run(
            [*command, "--root", str(tmp_path)], capture_output=True, text=True, timeout=60
        )

    assert script("--check").returncode == 0
    assert script("--check", "--base", base).returncode == 1
    assert script("--base", base).returncode == 0
    assert script("--check", "--base", base).returncode == 0
    copied = tmp_path / "deploy" / "prometheus"
    names = [rule["alert"] for rule in alert_rules(copied / "alerts.yml")]
    for name in names:
        assert f"runbook_url: {base}#{name.lower()}\n" in (copied / "alerts.yml").read_text()
    tested = (copied / "alerts_test.yml").read_text()
    assert "github.com" not in tested and f"{base}#" in tested
    rule = (tmp_path / "k8s/components/monitoring/prometheusrule.yaml").read_text()
    assert "github.com" not in rule and rule.count(f"{base}#") == len(names)
    refused = script("--base", "docs/runbook.md")
    assert refused.returncode == 2 and "absolute" in refused.stderr
