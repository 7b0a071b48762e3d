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
from tests.support import PATIENCE_SECONDS, ROOT, GatewayProcess, free_port, wait_until

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


def refusal(*args: str, env: dict[str, str] | None = None) -> str:
    """The one line `prefix-gateway ARGS` writes as it exits with status 2."""
    ended = command(*args, env=env)
    assert ended.returncode == 2, ended.stdout
    (line,) = ended.stderr.splitlines()
    return line


def written(tmp_path: Path, text: str, name: str = "gateway.yaml") -> Path:
    """A settings file of `text` in `tmp_path`."""
    path = tmp_path / name
    path.write_text(text)
    return path


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
        gateway.url + "/admin/backends",
        headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
        timeout=PATIENCE_SECONDS,
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
    wait_until(
        lambda: httpx.get(gateway.url + "/ready", timeout=PATIENCE_SECONDS).status_code == 200,
        "a replica up",
    )
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
    assert httpx.delete(
        f"{gateway.url}/admin/backends/{closed_name}", headers=admin, timeout=PATIENCE_SECONDS
    ).is_success
    unknown = refused("served-by-the-unreachable-one")
    assert (unknown.status_code, unknown.code) == (404, "model_not_found")
    # No replica reachable at all: every model is a 503.
    added = httpx.post(
        gateway.url + "/admin/backends",
        json={"url": closed},
        headers=admin,
        timeout=PATIENCE_SECONDS,
    )
    assert added.status_code == 201
    reachable = replica.urls[0].removeprefix("http://")
    assert httpx.delete(
        f"{gateway.url}/admin/backends/{reachable}", headers=admin, timeout=PATIENCE_SECONDS
    ).is_success
    alone = refused(MODEL)
    assert (alone.status_code, alone.code) == (503, "no_healthy_backend")
    assert alone.response.headers["retry-after"] == "1"
    # Back as the module's other tests expect it.
    restored = httpx.post(
        gateway.url + "/admin/backends",
        json={"url": replica.urls[0]},
        headers=admin,
        timeout=PATIENCE_SECONDS,
    )
    assert restored.status_code == 201


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
    assert refusal("serve", "--port", str(free_port()), "--backend", spec) == (
        f"prefix-gateway: backend {spec!r} {why}: give http://HOST:PORT, https://HOST:PORT"
        " or HOST:PORT"
    )


def test_config_prints_the_effective_settings_with_secrets_redacted(tmp_path: Path) -> None:
    settings_file = written(
        tmp_path, "tenants:\n  - name: search\n    api_key: tenant-secret-key\nmax_queue: 7\n"
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
        "--k8s-api-url",
        "https://admin:k8s-password@10.0.0.4:6443/?token=k8s-token&x=1",
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
    assert printed["k8s_api_url"] == (
        f"https://admin:{REDACTED}@10.0.0.4:6443/?token={REDACTED}&x=1"
    )
    assert "-secret-key" not in ended.stdout and "redis-password" not in ended.stdout
    assert "k8s-password" not in ended.stdout and "k8s-token" not in ended.stdout


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("policy: prefix\n  max_queue: 3\n", "line 2, column 12: mapping values are not allowed"),
        ("backend: [http://a:1\n", "line 2, column 1: expected ',' or ']'"),
        ("policy: @prefix\n", "line 1, column 9: found character '@'"),
    ],
)
@pytest.mark.parametrize("subcommand", ["serve", "config", "doctor"])
def test_a_file_that_is_not_yaml_is_one_line_and_exit_status_2(
    tmp_path: Path, text: str, where: str, subcommand: str
) -> None:
    settings_file = written(tmp_path, text)
    line = refusal(subcommand, "--config", str(settings_file))
    assert line.startswith(f"prefix-gateway: {settings_file}: not valid YAML: {where}"), line


def test_a_misspelt_key_of_the_file_names_the_closest_setting(tmp_path: Path) -> None:
    settings_file = written(tmp_path, "backends_dns: vllm:8000\npolcy: prefix\nflavour: 1\n")
    assert refusal("config", "--config", str(settings_file)) == (
        f"prefix-gateway: {settings_file}: unknown settings 'backends_dns' (did you mean"
        " backend_dns?), 'flavour', 'polcy' (did you mean policy?)"
    )


def test_configs_output_reads_back_as_the_same_configuration(tmp_path: Path) -> None:
    """Tenants keyed by variables print their variables: two of them read back as they were."""
    settings_file = written(
        tmp_path,
        "backend: [http://10.0.0.2:8000]\ntenants:\n"
        "  - {name: search, api_key_env: SEARCH_KEY, tokens_per_minute: 90000}\n"
        "  - {name: batch, api_key_env: BATCH_KEY, priority: -1}\n",
    )
    keys = {"SEARCH_KEY": "search-secret-key", "BATCH_KEY": "batch-secret-key"}
    first = command("config", "--config", str(settings_file), env=keys)
    assert first.returncode == 0, first.stderr
    assert "-secret-key" not in first.stdout
    printed = written(tmp_path, first.stdout, "printed.yaml")
    again = command("config", "--config", str(printed), env=keys)
    assert again.returncode == 0, again.stderr
    assert again.stdout == first.stdout
    tenants = yaml.safe_load(again.stdout)["tenants"]
    assert [(t["name"], t["api_key_env"]) for t in tenants] == [
        ("search", "SEARCH_KEY"),
        ("batch", "BATCH_KEY"),
    ]


@pytest.mark.parametrize(
    ("given", "refused"),
    [
        (
            "tenants:\n  - {name: search, api_key: key-1}\n  - {name: batch, api_key: key-2}\n",
            "tenants[0] (search): api_key is '<redacted>'",
        ),
        ("admin_token: admin-secret\n", "admin_token is '<redacted>'"),
        ("upstream_api_key: upstream-secret\n", "upstream_api_key is '<redacted>'"),
        ("redis_url: redis://:pass@cache:6379/0\n", "the password in redis_url is '<redacted>'"),
        (
            "k8s_api_url: https://token-user@10.0.0.4:6443\n",
            "the credentials in k8s_api_url is '<redacted>'",
        ),
    ],
)
def test_a_redacted_secret_read_back_is_refused_not_taken_as_the_secret(
    tmp_path: Path, given: str, refused: str
) -> None:
    settings_file = written(tmp_path, "backend: [http://10.0.0.2:8000]\n" + given)
    first = command("config", "--config", str(settings_file))
    assert first.returncode == 0, first.stderr
    printed = written(tmp_path, first.stdout, "printed.yaml")
    assert refusal("config", "--config", str(printed)) == (
        f"prefix-gateway: {refused}, what `prefix-gateway config` prints in place of a secret:"
        " give the secret itself"
    )


def test_the_placeholder_given_as_a_variable_is_refused_by_serve_too() -> None:
    line = refusal("serve", "--backend", "http://a:1", env={"GATEWAY_ADMIN_TOKEN": REDACTED})
    assert line.startswith("prefix-gateway: admin_token is '<redacted>'")


def test_config_refuses_what_serve_refuses() -> None:
    assert "fastest" in refusal("config", "--backend", "http://a:1", "--policy", "fastest")


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
