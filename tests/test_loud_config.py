"""Misconfiguration is reported, not ignored: a replica on a closed port, misspelt variables, bad
backend URLs; the effective configuration and the version are printed on request."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import httpx
import openai
import pytest
import yaml

import prefix_gateway
from engines.fleet import gateway_flags, parse_options
from prefix_gateway.backends.backend import Backend
from prefix_gateway.config import Settings
from prefix_gateway.config.effective import REDACTED
from prefix_gateway.emulator.replicas import EmulatedReplicas
from tests.support import ROOT, GatewayProcess, free_port, wait_until

MODEL = "emulated-model"
ADMIN_TOKEN = "admin-secret-1234"


def command(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`prefix-gateway ARGS` run to its end, from the checkout."""
    return subprocess.run(
        [sys.executable, "-m", "prefix_gateway", *args],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def replica() -> Iterator[EmulatedReplicas]:
    with EmulatedReplicas(1, MODEL) as started:
        yield started


@pytest.fixture(scope="module")
def closed() -> str:
    """A replica URL on a port nothing listens on."""
    return f"http://127.0.0.1:{free_port()}"


@pytest.fixture(scope="module")
def gateway(replica: EmulatedReplicas, closed: str) -> Iterator[GatewayProcess]:
    with GatewayProcess(
        [closed, *replica.urls],
        "--log-level",
        "info",
        "--admin-token",
        ADMIN_TOKEN,
        env={"GATEWAY_POLCY": "random"},
    ) as started:
        yield started


def backends(gateway: GatewayProcess) -> dict[str, dict[str, object]]:
    answer = httpx.get(
        gateway.url + "/admin/backends", headers={"authorization": f"Bearer {ADMIN_TOKEN}"}
    )
    assert answer.status_code == 200
    return {item["name"]: item for item in answer.json()["data"]}


def test_a_replica_on_a_closed_port_is_logged_with_its_reason_and_listed_with_it(
    gateway: GatewayProcess, closed: str
) -> None:
    name = closed.removeprefix("http://")
    logged = f"backend {name} failed its health probe: GET /health: ConnectError"
    wait_until(lambda: logged in gateway.log(), "the failed probe logged")
    listed = backends(gateway)
    assert listed[name]["healthy"] is False
    assert str(listed[name]["last_probe_error"]).startswith("GET /health: ConnectError")
    reachable = next(item for key, item in listed.items() if key != name)
    wait_until(lambda: backends(gateway)[str(reachable["name"])]["healthy"], "the replica up")
    assert backends(gateway)[str(reachable["name"])]["last_probe_error"] is None


def test_a_model_no_reachable_replica_has_listed_is_a_503_not_a_404(
    gateway: GatewayProcess, replica: EmulatedReplicas, closed: str
) -> None:
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    wait_until(lambda: httpx.get(gateway.url + "/ready").status_code == 200, "a replica up")
    assert client.completions.create(model=MODEL, prompt="hello", max_tokens=1).choices

    def refused(model: str) -> openai.APIStatusError:
        with pytest.raises(openai.APIStatusError) as caught:
            client.completions.create(model=model, prompt="x", max_tokens=1)
        return caught.value

    # The replica that never answered may serve it: not "does not exist", but "retry".
    unreachable = refused("served-by-the-unreachable-one")
    assert (unreachable.status_code, unreachable.code) == (503, "no_healthy_backend")
    assert unreachable.response.headers["retry-after"] == "1"
    # Once every replica has listed its models, a model none lists does not exist.
    closed_name = closed.removeprefix("http://")
    assert httpx.delete(f"{gateway.url}/admin/backends/{closed_name}", headers=admin).is_success
    unknown = refused("served-by-the-unreachable-one")
    assert (unknown.status_code, unknown.code) == (404, "model_not_found")
    # No replica reachable at all: every model is a 503.
    added = httpx.post(gateway.url + "/admin/backends", json={"url": closed}, headers=admin)
    assert added.status_code == 201
    reachable = replica.urls[0].removeprefix("http://")
    assert httpx.delete(f"{gateway.url}/admin/backends/{reachable}", headers=admin).is_success
    alone = refused(MODEL)
    assert (alone.status_code, alone.code) == (503, "no_healthy_backend")
    assert alone.response.headers["retry-after"] == "1"


def test_the_start_logs_misspelt_variables_and_the_configuration_without_secrets(
    gateway: GatewayProcess, closed: str
) -> None:
    log = gateway.log()
    assert "unknown variable GATEWAY_POLCY is ignored; did you mean GATEWAY_POLICY?" in log
    # One JSON record a line (--log-format json, the default): the configuration is its message.
    messages = [json.loads(line).get("message", "") for line in log.splitlines() if line]
    logged = [m for m in messages if m.startswith("effective configuration: ")]
    assert len(logged) == 1, messages
    configuration = json.loads(logged[0].removeprefix("effective configuration: "))
    assert configuration["backend"][0] == closed
    assert configuration["policy"] == "prefix"
    assert configuration["admin_token"] == REDACTED
    assert ADMIN_TOKEN not in log


def test_a_probe_failure_is_reported_once_per_run_of_failures() -> None:
    backend = Backend("a:1", "http://a:1")
    assert backend.probe_answered("GET /health: ConnectError") is True
    assert backend.probe_answered("GET /health: ConnectError") is False
    assert backend.probe_answered("") is False
    assert backend.last_probe_error == "GET /health: ConnectError"
    assert backend.probe_answered("GET /health: answered 503") is True


@pytest.mark.parametrize(
    ("spec", "why"),
    [("ftp://x:1", "is not an http(s) URL"), ("not-a-url", "is not a URL")],
)
def test_a_bad_backend_url_is_one_line_and_exit_status_2(spec: str, why: str) -> None:
    ended = command("serve", "--port", str(free_port()), "--backend", spec)
    assert ended.returncode == 2
    assert ended.stderr.splitlines() == [
        f"prefix-gateway: backend {spec!r} {why}: give http://HOST:PORT, https://HOST:PORT"
        " or HOST:PORT"
    ]


def test_config_prints_the_effective_settings_with_secrets_redacted(tmp_path: Path) -> None:
    settings_file = tmp_path / "gateway.yaml"
    settings_file.write_text(
        "tenants:\n  - name: search\n    api_key: tenant-secret-key\nmax_queue: 7\n"
    )
    ended = command(
        "config",
        "--config",
        str(settings_file),
        "--backend",
        "llama=10.0.0.2:8000",
        "--api-key",
        "client-secret-key",
        "--upstream-api-key",
        "upstream-secret-key",
        "--redis-url",
        "redis://cache:redis-password@10.0.0.3:6379/0",
        env={"GATEWAY_BACKEND": "http://10.0.0.9:8000", "GATEWAY_QUEUE_TIMEOUT": "9"},
    )
    assert ended.returncode == 0, ended.stderr
    assert ended.stderr.splitlines() == [
        "prefix-gateway: warning: unknown variable GATEWAY_BACKEND is ignored;"
        " did you mean GATEWAY_BACKENDS?"
    ]
    printed = yaml.safe_load(ended.stdout)
    assert list(printed) == list(Settings.__dataclass_fields__)
    assert printed["backend"] == ["llama=10.0.0.2:8000"]
    assert (printed["max_queue"], printed["queue_timeout"]) == (7, 9.0)
    assert printed["api_key"] == [REDACTED]
    assert printed["upstream_api_key"] == REDACTED
    assert printed["admin_token"] == ""  # not set: shown as such
    assert printed["redis_url"] == f"redis://cache:{REDACTED}@10.0.0.3:6379/0"
    assert printed["tenants"][0]["name"] == "search"
    assert printed["tenants"][0]["api_key"] == REDACTED
    assert "-secret-key" not in ended.stdout and "redis-password" not in ended.stdout


def test_config_refuses_what_serve_refuses() -> None:
    ended = command("config", "--backend", "http://a:1", "--policy", "fastest")
    assert ended.returncode == 2
    assert len(ended.stderr.splitlines()) == 1 and "fastest" in ended.stderr


def test_version_is_the_package_metadata_version() -> None:
    ended = command("--version")
    assert ended.returncode == 0
    assert ended.stdout.strip() == f"prefix-gateway {prefix_gateway.__version__}"
    assert version("prefix-gateway") == prefix_gateway.__version__


def test_run_real_routes_with_the_model_tokenizer_and_the_engines_block_size(
    tmp_path: Path,
) -> None:
    options = parse_options(["--block-size", "32"])
    flags = gateway_flags(options, ["http://127.0.0.1:8001", "http://127.0.0.1:8002"], tmp_path)
    ended = command("config", *flags)
    assert ended.returncode == 0, ended.stderr
    printed = yaml.safe_load(ended.stdout)
    assert printed["tokenizer"] == str(tmp_path)
    assert (printed["engine_block_size"], printed["block_tokens"]) == (32, 32)
    overridden = gateway_flags(parse_options(["--", "--engine-block-size", "16"]), [], tmp_path)
    assert (
        yaml.safe_load(command("config", *overridden, "--emulate", "1").stdout)["block_tokens"]
        == 16
    )
