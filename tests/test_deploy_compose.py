"""deploy/compose.yaml, checked without a container engine: references, ports, files, settings,
and the Prometheus scrape config's targets.

The gateway's environment is loaded by the gateway's own settings loader and the replicas'
commands by its own command-line parser, so a misspelt variable or flag fails here.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from prefix_gateway.backends.membership import ServiceSpec
from prefix_gateway.cli import build_parser
from prefix_gateway.config import Settings, _env_name, load_settings
from tests.readme import assignments, commands

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "deploy" / "compose.yaml"
SETTINGS_VARIABLES = {_env_name(field) for field in dataclasses.fields(Settings)}
_VARIABLE = re.compile(r"\$\{(?P<name>\w+)(?:(?P<op>:?[-?])(?P<default>[^}]*))?\}")
REQUIRED = {"GRAFANA_ADMIN_PASSWORD": "set-by-the-operator"}
"""The variables compose must be given (no default is safe), with stand-ins."""


def interpolate(value: Any) -> Any:
    """Compose's `${NAME}`, `${NAME:-default}` and `${NAME:?error}`, with only `REQUIRED` set."""
    if isinstance(value, str):

        def replace(match: re.Match[str]) -> str:
            op = match.group("op") or ""
            if "?" in op:
                assert match.group("name") in REQUIRED, f"{match.group(0)} must be set"
                return REQUIRED[match.group("name")]
            return match.group("default") or ""

        return _VARIABLE.sub(replace, value)
    if isinstance(value, list):
        return [interpolate(item) for item in value]
    if isinstance(value, dict):
        return {key: interpolate(item) for key, item in value.items()}
    return value


COMPOSE_FILE: dict[str, Any] = interpolate(yaml.safe_load(COMPOSE.read_text()))
SERVICES: dict[str, dict[str, Any]] = COMPOSE_FILE["services"]
GATEWAYS = [name for name, service in SERVICES.items() if name.startswith("gateway")]


def command_of(service: dict[str, Any]) -> list[str]:
    command = service.get("command", [])
    return shlex.split(command) if isinstance(command, str) else list(command)


def depends_on(service: dict[str, Any]) -> list[str]:
    value = service.get("depends_on", [])
    return list(value) if isinstance(value, (list, dict)) else []


def test_the_system_and_both_replica_profiles_are_there() -> None:
    assert len(GATEWAYS) >= 2
    for always in ("redis", "prometheus", "grafana", *GATEWAYS):
        assert "profiles" not in SERVICES[always], f"{always} runs in every profile"
    profiles = {profile for service in SERVICES.values() for profile in service.get("profiles", [])}
    assert profiles == {"cpu", "gpu"}


def test_every_dependency_exists_and_is_started_with_its_dependent() -> None:
    for name, service in SERVICES.items():
        for needed in depends_on(service):
            assert needed in SERVICES, f"{name} depends on unknown service {needed}"
            own = set(service.get("profiles", []))
            theirs = set(SERVICES[needed].get("profiles", []))
            assert not theirs or (own and own <= theirs), f"{name} needs {needed} off-profile"
        conditions = service.get("depends_on", {})
        if isinstance(conditions, dict):
            for needed, rule in conditions.items():
                if rule.get("condition") == "service_healthy":
                    assert "healthcheck" in SERVICES[needed], f"{needed} has no healthcheck"


def test_published_ports_are_well_formed_unique_and_local() -> None:
    published: set[int] = set()
    for name, service in SERVICES.items():
        for spec in service.get("ports", []):
            parts = str(spec).split(":")
            assert len(parts) == 3, f"{name}: bind {spec} to an address"
            address, host, container = parts
            assert address == "127.0.0.1", f"{name}: {spec} is open beyond this machine"
            assert 0 < int(host) < 65536 and 0 < int(container) < 65536
            assert int(host) not in published, f"host port {host} published twice"
            published.add(int(host))
    for gateway in GATEWAYS:
        (spec,) = SERVICES[gateway]["ports"]
        port = load_settings(environ=gateway_environment(gateway)).port
        assert spec.endswith(f":{port}"), "the container port is the one the gateway listens on"


def test_mounted_files_and_build_context_exist_in_the_repository() -> None:
    base = COMPOSE.parent
    mounts = 0
    for name, service in SERVICES.items():
        for volume in service.get("volumes", []):
            source = str(volume).split(":")[0]
            if source.startswith((".", "/")):
                assert (base / source).exists(), f"{name} mounts missing {source}"
                mounts += 1
            else:
                assert source in COMPOSE_FILE.get("volumes", {}), f"{name}: no volume {source}"
        build = service.get("build")
        if build:
            context = base / build["context"]
            assert (context / build.get("dockerfile", "Dockerfile")).is_file()
    assert mounts >= 4
    prometheus = SERVICES["prometheus"]["volumes"]
    assert "./prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prometheus
    assert "./prometheus/alerts.yml:/etc/prometheus/alerts.yml:ro" in prometheus
    grafana = [str(volume).split(":")[0] for volume in SERVICES["grafana"]["volumes"]]
    assert grafana == ["./grafana/provisioning", "./grafana/dashboards"]


def gateway_environment(name: str) -> dict[str, str]:
    return {key: str(value) for key, value in SERVICES[name]["environment"].items()}


@pytest.mark.parametrize("gateway", GATEWAYS)
def test_gateway_environment_is_real_settings(gateway: str) -> None:
    environment = gateway_environment(gateway)
    unknown = {key for key in environment if key.startswith("GATEWAY_")} - SETTINGS_VARIABLES
    assert not unknown, f"not settings of prefix_gateway/config.py: {unknown}"
    assert "GATEWAY_HOST" not in environment or environment["GATEWAY_HOST"] == "0.0.0.0"
    settings = load_settings(environ=environment)
    assert settings.redis_url.startswith("redis://redis:")
    assert settings.backend_dns
    for spec in settings.backend_dns:
        target = ServiceSpec.parse(spec, port_required=True)
        assert target.host in SERVICES, f"{spec} names no compose service"
        assert f"--port {target.port}" in " ".join(command_of(SERVICES[target.host]))


def test_prometheus_scrapes_every_gateway_on_its_metrics_port() -> None:
    config = yaml.safe_load((COMPOSE.parent / "prometheus" / "prometheus.yml").read_text())
    (job,) = (job for job in config["scrape_configs"] if job["job_name"] == "prefix-gateway")
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = [target for group in job["static_configs"] for target in group["targets"]]
    wanted = []
    for gateway in GATEWAYS:
        settings = load_settings(environ=gateway_environment(gateway))
        assert settings.metrics_port, f"{gateway} serves /metrics on its API port"
        wanted.append(f"{gateway}:{settings.metrics_port}")
    assert sorted(targets) == sorted(wanted)


def test_emulated_replicas_take_our_own_flags() -> None:
    replica = SERVICES["replica"]
    assert replica["profiles"] == ["cpu"]
    assert replica["deploy"]["replicas"] >= 2
    command = command_of(replica)
    assert command[:1] == ["emulate"], "the image's entrypoint is prefix-gateway"
    arguments = build_parser().parse_args(command)
    assert arguments.host == "0.0.0.0" and arguments.port == 8000


def test_real_engines_cache_prefixes_and_report_cached_tokens() -> None:
    vllm = command_of(SERVICES["vllm"])
    assert {"--enable-prefix-caching", "--enable-prompt-tokens-details"} <= set(vllm)
    sglang = command_of(SERVICES["sglang"])
    assert "--enable-cache-report" in sglang and "--disable-radix-cache" not in sglang
    for engine in ("vllm", "sglang"):
        service = SERVICES[engine]
        assert service["profiles"] == ["gpu"]
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"]


def test_grafanas_admin_password_must_be_given_and_has_no_default() -> None:
    raw = yaml.safe_load(COMPOSE.read_text())["services"]["grafana"]["environment"]
    password = raw["GF_SECURITY_ADMIN_PASSWORD"]
    match = _VARIABLE.fullmatch(password)
    assert match is not None and match.group("op") == ":?", f"a default or a literal: {password}"
    assert (
        SERVICES["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"]
        == REQUIRED[match.group("name")]
    )


_REPOSITORY_PATH = re.compile(
    r"(?<![\w./-])((?:k8s|deploy|docs|scripts|loadtest|engines|prefix_gateway)/[\w./-]*\w)"
)


def test_every_repository_path_the_deployment_files_name_exists() -> None:
    """A comment that sends the reader to a file that moved is a dead end."""
    named = 0
    for folder in (ROOT / "deploy", ROOT / "k8s"):
        for path in sorted(folder.rglob("*")):
            if not path.is_file():
                continue
            for match in _REPOSITORY_PATH.finditer(path.read_text(encoding="utf-8")):
                named += 1
                target = match.group(1)
                # Files the operator creates (deploy/.env) are not the repository's.
                if not Path(target).name.startswith("."):
                    assert (ROOT / target).exists(), f"{path.relative_to(ROOT)} names {target}"
    assert named > 20


def test_the_readme_compose_commands_give_every_variable_compose_requires() -> None:
    """`${NAME:?...}` stops compose before it starts anything: the README must set each one."""
    required = {
        match["name"]
        for match in _VARIABLE.finditer(COMPOSE.read_text())
        if "?" in (match["op"] or "")
    }
    assert required == set(REQUIRED)
    exported: dict[str, str] = {}
    started = 0
    for words in commands("Docker Compose"):
        given, rest = assignments(words)
        if words[0] == "export":
            exported.update(given)
            continue
        if rest[:2] != ["docker", "compose"]:
            continue
        started += 1
        assert (ROOT / "deploy" / "compose.yaml").samefile(ROOT / rest[rest.index("-f") + 1])
        profile = rest[rest.index("--profile") + 1]
        assert any(profile in service.get("profiles", []) for service in SERVICES.values())
        missing = required - set(exported) - set(given)
        assert not missing, f"{' '.join(words)}: compose refuses to start without {missing}"
    assert started == 2


def test_the_engines_run_the_releases_the_kubernetes_overlays_pin() -> None:
    def image(path: str) -> str:
        documents = yaml.safe_load_all((ROOT / "k8s" / "overlays" / path).read_text())
        (container,) = [
            container
            for document in documents
            if document and document["kind"] in ("Deployment", "StatefulSet")
            for container in document["spec"]["template"]["spec"]["containers"]
        ]
        return str(container["image"])

    for service, overlay in (("vllm", "vllm/vllm.yaml"), ("sglang", "sglang/sglang.yaml")):
        composed = SERVICES[service]["image"]  # with the defaults of `${..._VERSION:-...}`
        assert composed == image(overlay), service
        assert not composed.endswith(":latest"), f"{service} runs whatever is newest"
